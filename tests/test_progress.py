"""hftrain/progress.py: start-up narration (the quickstart's no-silence test is tests/test_readme.py)."""

from __future__ import annotations

import time

from hftrain import progress
from hftrain.cli import main


def test_a_refused_train_in_this_process_leaves_no_narrator_talking(tmp_path, capsys, monkeypatch):
    """Before: `main(["train", ...])` that failed before step 1 (a notebook, a test) left the watchdog printing
    "hftrain: still starting (2752 s)" into the rest of the process's output."""
    monkeypatch.setattr(progress, "STILL_EVERY_S", 0.3)
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert not progress._narrator.running.is_set()  # noqa: SLF001
    capsys.readouterr()
    time.sleep(1.0)
    assert "still" not in capsys.readouterr().err


def test_phases_are_said_on_stderr_and_recognised_as_narration(capsys, monkeypatch):
    monkeypatch.setattr(progress, "STILL_EVERY_S", 0.3)
    with progress.phase("training a tokenizer"):
        time.sleep(0.9)
    printed = capsys.readouterr()
    lines = printed.err.splitlines()
    assert printed.out == "" and lines[0] == "hftrain: training a tokenizer ..."
    assert any(line.startswith("hftrain: still training a tokenizer (") for line in lines[1:]), lines
    assert all(progress.is_narration(line) for line in lines)
    assert not progress.is_narration("hftrain: error: data.readers: 3 readers.")
    assert not progress._narrator.running.is_set()  # noqa: SLF001  (the phase started it, the phase stopped it)
