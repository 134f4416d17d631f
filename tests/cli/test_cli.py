"""The command line as a user runs it: subprocesses, exit codes, messages without tracebacks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from hftrain.checkpoint.layout import RunLayout
from ..support.checks import loss_records
from ..support.cli import ROOT, run_cli
from ..support.data import tiny_recipe


def write_recipe(tmp_path: Path, corpus: Path, **training) -> Path:
    raw = tiny_recipe(corpus, tmp_path / "run", **training)
    raw["monitor"]["plot"] = True
    raw["training"]["report_to"] = ["tensorboard"]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_train_prints_the_summary_and_writes_outputs(tmp_path, corpus):
    recipe = write_recipe(tmp_path, corpus)
    result = run_cli("train", str(recipe), "training.max_steps=12", "training.logging_steps=4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"final checkpoint: {tmp_path / 'run' / 'final'}" in out
    assert "validation loss" in out and "perplexity" in out and "sample: 'The " in out
    run = tmp_path / "run"
    assert RunLayout(run).plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(run.rglob("events.out.tfevents.*")), "TensorBoard logs"
    state = json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())
    assert [e["step"] for e in loss_records(state["log_history"])] == [4, 8]  # overrides took effect
    assert json.loads(RunLayout(run).results.read_text())["step"] == 12


def test_bad_recipe_exits_2_with_one_message(tmp_path, corpus):
    recipe = write_recipe(tmp_path, corpus)
    result = run_cli("train", str(recipe), "training.learnig_rate=0.1")
    assert result.returncode == 2
    assert "training.learnig_rate: unknown key; did you mean training.learning_rate?" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
def test_bad_data_line_exits_2_naming_file_and_line(tmp_path, corpus):
    lines = corpus.read_text().splitlines()
    lines[7] = '{"text": "unterminated'
    corpus.write_text("\n".join(lines) + "\n")
    result = run_cli("train", str(write_recipe(tmp_path, corpus)))
    assert result.returncode == 2
    assert f"{corpus}:8: not valid JSON" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_plan_with_overrides_anywhere():
    result = run_cli("plan", "recipes/pretrain/pythia-1b.yaml")
    assert result.returncode == 0, result.stderr
    assert "1,011,781,632 total" in result.stdout and "FLOPs per token" in result.stdout and "fp32" in result.stdout
    moved = run_cli("plan", "model.preset=pythia-70m", "recipes/quickstart.yaml", "data.seq_len=64")
    assert moved.returncode == 0, moved.stderr
    assert "model pythia-70m: 6 layers, hidden 512, 8 heads, vocab 4,096" in moved.stdout  # quickstart's 4k BPE


@pytest.mark.slow
def test_help_shows_field_docs():
    result = run_cli("train", "--help")
    assert result.returncode == 0
    assert "Tokens per training block" in result.stdout  # data.seq_len's docstring
    assert "Named GPT-NeoX shape" in result.stdout  # model.preset's docstring
    training = run_cli("explain", "training")
    assert "learning_rate" in training.stdout and "The initial learning rate for" in training.stdout


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "hftrain"
    assert script.is_file() and os.access(script, os.X_OK)


@pytest.mark.slow
def test_quickstart_as_shipped(tmp_path):
    """The README's quickstart, unchanged: the loss falls visibly and every promised output appears."""
    import subprocess

    script = Path(sys.executable).parent / "hftrain"
    result = subprocess.run([str(script), "train", str(ROOT / "recipes" / "quickstart.yaml")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart"
    history = json.loads((run / "checkpoint-600" / "trainer_state.json").read_text())["log_history"]
    first = next(e["loss"] for e in loss_records(history))
    results = json.loads(RunLayout(run).results.read_text())
    assert results["step"] == 600
    assert first > 7.5 and results["eval_loss"] < first - 2.5, (first, results["eval_loss"])
    assert "final checkpoint: runs/quickstart/final" in result.stdout
    assert RunLayout(run).plot.is_file() and results["sample"].startswith("Return the ")
    assert "it/s" in result.stderr  # the progress bar
