"""`hftrain train` as a user runs it: its summary, outputs and exit code through the CLI's own entry point in
this process, and the quickstart as shipped through the installed console script. Every refusal's message:
tests/bad_input/."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from hftrain.checkpoint.layout import RunLayout

from ..support.checks import loss_records
from ..support.cli import ROOT, in_process
from ..support.data import tiny_recipe


def write_recipe(tmp_path: Path, corpus: Path, **training) -> Path:
    raw = tiny_recipe(corpus, tmp_path / "run", **training)
    raw["monitor"]["plot"] = True
    raw["training"]["report_to"] = ["tensorboard"]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_train_prints_the_summary_and_writes_outputs(tmp_path, corpus, capsys, monkeypatch):
    recipe = write_recipe(tmp_path, corpus)
    monkeypatch.chdir(tmp_path)
    code, printed = in_process(capsys, "train", str(recipe), "training.max_steps=12", "training.logging_steps=4")
    assert code == 0, printed[-3000:]
    assert f"final checkpoint: {tmp_path / 'run' / 'final'}" in printed
    assert "validation loss" in printed and "perplexity" in printed and "sample: 'The " in printed
    run = tmp_path / "run"
    assert RunLayout(run).plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(run.rglob("events.out.tfevents.*")), "TensorBoard logs"
    state = json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())
    assert [e["step"] for e in loss_records(state["log_history"])] == [4, 8]  # overrides took effect
    assert json.loads(RunLayout(run).results.read_text())["step"] == 12


@pytest.mark.slow(seconds=300)  # the suite's order: the longest files start first (tests/conftest.py)
def test_quickstart_as_shipped(tmp_path):
    """The README's quickstart, unchanged, on a machine new to hftrain (no speed probe, no parsed corpus cached):
    its start-up (imports, speed probe, tokenizer, corpus, first shuffle window) never goes 10 s without a line
    (issue 33, class 8; before: nothing for the ~20 s of the probe and tokenizer, 116 s on an emulated-bf16 CPU),
    the loss falls visibly and every promised output appears."""
    import subprocess
    import time

    script = Path(sys.executable).parent / "hftrain"
    env = {**os.environ, "HFTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(script), "train", str(ROOT / "recipes" / "quickstart.yaml")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=0,
    )
    lines, said, partial = [], b"", b""  # lines: (seconds since the start, line) until the first step is done
    try:
        while chunk := os.read(proc.stdout.fileno(), 65536):
            now, said = time.monotonic() - started, said + chunk
            *complete, partial = re.split(rb"[\r\n]", partial + chunk)
            for line in complete if not any("| 1/600 [" in line for _, line in lines) else ():
                lines.append((now, line.decode(errors="replace")))
    finally:
        proc.stdout.close()
        code = proc.wait(timeout=900)
    said = said.decode(errors="replace")
    assert code == 0, said[-3000:]
    shown = "\n".join(f"{t:6.1f} {line[:120]}" for t, line in lines)
    assert any("| 1/600 [" in line for _, line in lines), shown
    for announced in (
        "hftrain: measuring this CPU's step speed in fp32 and bf16",
        "hftrain: training a 4,096-token BPE tokenizer",
        "hftrain: reading the docstrings of",
        "hftrain: filling the first shuffle window (4,096 blocks of 128 tokens)",
    ):
        assert any(announced in line for _, line in lines), (announced, shown)
    gap = max(later[0] - earlier[0] for earlier, later in zip([(0.0, "")] + lines, lines))
    assert gap <= 10.0, shown
    print(f"first step after {lines[-1][0]:.1f} s; longest silence before it {gap:.1f} s")

    run = tmp_path / "runs" / "quickstart"
    history = json.loads((run / "checkpoint-600" / "trainer_state.json").read_text())["log_history"]
    first = next(e["loss"] for e in loss_records(history))
    results = json.loads(RunLayout(run).results.read_text())
    assert results["step"] == 600
    assert first > 7.5 and results["eval_loss"] < first - 2.5, (first, results["eval_loss"])
    assert "final checkpoint: runs/quickstart/final" in said
    assert RunLayout(run).plot.is_file() and results["sample"].startswith("Return the ")
    assert "it/s" in said  # the progress bar
