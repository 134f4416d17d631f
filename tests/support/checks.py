"""Checks the tests share: per-step losses from a run's logs, the straight-vs-resumed comparison, leaving a
run directory as a run killed after a checkpoint would have left it, and damaging a checkpoint's file."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from hftrain.checkpoint import manager as ckpt
from hftrain.checkpoint.layout import TRAINER_STATE_FILE, RunLayout


def tree_digest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`: what "left byte-identical" compares."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------------------------- losses


def loss_records(history: Iterable[dict]) -> list[dict]:
    """The training-step entries of a log: those with a "loss" (evaluation entries have "eval_loss" instead)."""
    return [e for e in history if "loss" in e]


def step_losses(history: Iterable[dict]) -> dict[int, float]:
    """{step: loss} of a log's training steps."""
    return {e["step"]: e["loss"] for e in loss_records(history)}


def losses(run: Any) -> dict[int, float]:
    """{step: loss} of a run trained in this process (its `log_history`)."""
    return step_losses(run.log_history)


def read_metrics(run_dir: Path) -> list[dict]:
    """Every entry of a run directory's metrics.jsonl, in order."""
    return [json.loads(line) for line in RunLayout(run_dir).metrics.read_text(encoding="utf-8").splitlines()]


def train_log(run_dir: Path) -> list[dict]:
    """The training-step entries of a run directory's metrics.jsonl."""
    return loss_records(read_metrics(run_dir))


def metrics_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} from a run directory's metrics.jsonl (for runs in other processes)."""
    return step_losses(read_metrics(run_dir))


def steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad norm)} from a run directory's metrics.jsonl."""
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in train_log(run_dir)}


def assert_same_steps(reference: dict, other: dict, which: Iterable[int], label: Any) -> None:
    """Per step of `which`: the same loss (rel 1e-5) and grad norm (rel 1e-4) as `reference` (both from `steps`)."""
    for step in which:
        (loss, norm), (loss2, norm2) = reference[step], other[step]
        assert loss2 == pytest.approx(loss, rel=1e-5), (label, step, loss, loss2)
        assert norm2 == pytest.approx(norm, rel=1e-4), (label, step, norm, norm2)


def checkpoint_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} as saved in a run directory's latest complete checkpoint (its trainer_state.json)."""
    last = ckpt.complete_checkpoints(run_dir)[-1]
    return step_losses(json.loads((last / TRAINER_STATE_FILE).read_text())["log_history"])


# ---------------------------------------------------------------------------------------------- resuming


def copy_checkpoint(run_dir: Path, new_dir: Path, checkpoint: str) -> None:
    """Make `new_dir` what the run in `run_dir` would have left had it been killed right after `checkpoint`: that
    checkpoint, the trained tokenizer and the run file (so a resume there is the same run's own resume)."""
    new_dir.mkdir()
    for name in (checkpoint, RunLayout.TOKENIZER_DIR, RunLayout.RUN_FILE):
        (shutil.copytree if (run_dir / name).is_dir() else shutil.copy)(run_dir / name, new_dir / name)


def assert_resumed_matches(
    straight: dict[int, float], resumed: dict[int, float], steps: Iterable[int], label: Any = None
) -> None:
    """The straight-vs-resumed check: at every one of `steps`, the resumed run's loss is the straight run's (rel
    1e-5)."""
    for step in steps:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step if label is None else (label, step)


# ---------------------------------------------------------------------------------------------- damaged checkpoints


def cut_short(file: Path) -> Path:
    """`file` truncated to half its size, as a copy or a write that stopped part-way leaves it."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return file


def damaged_copy(checkpoint: Path, run_dir: Path, relative: str) -> Path:
    """A copy of `checkpoint` in `run_dir` whose file `relative` is cut short."""
    copy = run_dir / checkpoint.name
    shutil.copytree(checkpoint, copy)
    cut_short(copy / relative)
    return copy


def assert_export_refused(capsys, checkpoint: Path, relative: str, *extra: str) -> None:
    """`hftrain export` of a checkpoint whose file `relative` is cut short: exit 2 with one message naming the file
    (no traceback), and neither --out nor its staging directory left behind."""
    from .cli import in_process

    out = checkpoint.parent / "exported-damaged"
    code, printed = in_process(capsys, "export", str(checkpoint), "--out", str(out), *extra)
    assert code == 2 and "Traceback" not in printed, printed[-3000:]
    assert f"hftrain: error: {checkpoint / relative}: truncated (" in printed, printed[-3000:]
    assert printed.count("hftrain: error:") == 1 and "exported:" not in printed
    assert not out.exists() and not list(checkpoint.parent.glob(f".{out.name}*"))
