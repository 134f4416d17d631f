"""Preemption: SIGTERM mid-run saves at the next step and exits 75; running again loses no step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hftrain import checkpoint as ckpt

from .conftest import make_documents, tiny_recipe, write_jsonl


def losses_of(out: Path) -> dict[int, float]:
    last = max(ckpt.complete_checkpoints(out), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_resume_loses_nothing(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(400))
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(data, tmp_path / "unused", max_steps=120, save_steps=120, logging_steps=1)
    recipe.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe)]

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen([*cmd, f"training.output_dir={interrupted}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = interrupted / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 10) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    saved = ckpt.latest_checkpoint(interrupted)
    step = int(saved.name.split("-")[1])
    assert f"stopped by SIGTERM after step {step}" in err and "Run the same command again" in err
    assert 10 <= step < 120 and not (interrupted / "final").exists()

    again = subprocess.run([*cmd, f"training.output_dir={interrupted}"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    straight = tmp_path / "straight"
    done = subprocess.run([*cmd, f"training.output_dir={straight}"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed, reference = losses_of(interrupted), losses_of(straight)
    assert sorted(resumed) == list(range(1, 121))  # no step lost or repeated
    for s in range(step + 1, 121):
        assert resumed[s] == pytest.approx(reference[s], rel=1e-5), s
