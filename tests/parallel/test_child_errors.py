"""Errors from launched processes (issue 33): a refusal raised in every rank of `--accelerate-config` is said once,
with its exit code 2, without torchrun's ChildFailedError traceback, and `--max-restarts` does not restart it;
a rank that really crashes is still named with its exit. (hftrain/parallel/child_errors.py)"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from hftrain.parallel import child_errors, rehearsal
from hftrain.parallel.child_errors import ChildError

from ..support.checks import tree_digest
from ..support.cli import in_process
from ..support.data import make_documents, tiny_recipe, write_jsonl

# what every rank of a 2-process launch says about a recipe with data.readers=3 (hftrain/parallel/readers.py)
REFUSAL = (
    "data.readers: this run reads its data with 3 logical readers (fixed at its start), which cannot be split "
    "over 2 process(es) x 1 dataloader worker(s). With 1 worker(s) per process, 1, 3 process(es) work; or "
    "change training.dataloader_num_workers so that processes x workers divides data.readers."
)


@pytest.fixture
def refused(tmp_path: Path) -> Path:
    """A recipe whose 3 data readers cannot be split over 2 processes: each rank refuses it (not the launcher)."""
    work = tmp_path / "work"
    raw = tiny_recipe(write_jsonl(work / "docs.jsonl", make_documents(100)), work / "run", max_steps=2)
    raw["data"]["readers"] = 3
    path = work / "r.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def said_once(printed: str) -> None:
    assert [line for line in printed.splitlines() if line.startswith("hftrain: error:")] == [
        f"hftrain: error: {REFUSAL}"
    ], printed[-4000:]
    assert not [s for s in ("Traceback", "ChildFailedError", "failed (exitcode", "closing signal") if s in printed], (
        printed[-4000:]
    )


def digest_and_temp(recipe: Path, tmp_path: Path, monkeypatch) -> tuple[dict[str, str], Path]:
    temp = tmp_path / "tmp"  # the launcher's temporary files, outside the checked tree
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    return tree_digest(recipe.parent), temp


def nothing_changed(recipe: Path, before: dict[str, str], temp: Path) -> None:
    after = tree_digest(recipe.parent)
    assert {name: after.get(name) for name in before} == before  # every file that was there is byte-identical
    assert not list(temp.glob("hftrain-errors-*"))  # the launcher's error directory is removed


@pytest.mark.slow
def test_a_refusal_in_every_rank_is_said_once_with_exit_code_2(refused, tmp_path, monkeypatch, capfd):
    """The launcher in this process, its ranks started by it; what both print, at the file descriptors."""
    before, temp = digest_and_temp(refused, tmp_path, monkeypatch)
    start = time.monotonic()
    code, printed = in_process(capfd, "train", str(refused), "--accelerate-config", "ddp", "--nproc", "2")
    took = time.monotonic() - start
    assert code == 2, printed[-4000:]
    said_once(printed)
    assert took < 60
    nothing_changed(refused, before, temp)


@pytest.mark.slow
def test_max_restarts_does_not_restart_a_refusal_in_the_ranks(refused, tmp_path, monkeypatch, capfd):
    """What `hftrain train R --accelerate-config ddp --nproc 2 --max-restarts 2` runs (cli/train.py); the supervisor
    is called here, not started, to keep the test short: its child is the launcher, as from the command line."""
    from hftrain.launch.processes import supervise

    before, temp = digest_and_temp(refused, tmp_path, monkeypatch)
    start = time.monotonic()
    code = supervise(["train", str(refused), "--accelerate-config", "ddp", "--nproc", "2"], 2)
    took = time.monotonic() - start
    captured = capfd.readouterr()
    printed = captured.out + captured.err
    assert code == 2, printed[-4000:]
    said_once(printed)
    assert "hftrain: not restarted: a problem in the recipe or data (a restart would fail the same way)." in printed
    assert "restart 1 of 2" not in printed
    assert took < 60
    nothing_changed(refused, before, temp)


# What the processes do, in place of hftrain's CLI (cheap: no ML library is loaded): "refuse": every rank ends
# with the same user error through the contract, as cli/__init__.py does; "preempt": the launcher is sent SIGTERM and
# the ranks stop with Preempted's 75; "raise" / "kill": rank 1 crashes with an exception that is not hftrain's, or a
# SIGKILL, while rank 0 waits until the launcher stops it.
RANK_HOOK = """
import os, signal, sys, time

class _Rank:
    def find_spec(self, name, path=None, target=None):
        if name != "hftrain.cli":
            return None
        how, rank = os.environ.get("RANK_HOW"), os.environ.get("RANK")
        from hftrain.parallel import child_errors
        if how == "refuse":
            sys.exit(child_errors.say(2, "the recipe is refused.", child_errors.take_error_dir()))
        if how == "preempt":  # rank 0 sends the launcher the SIGTERM a scheduler would; it stops both ranks
            error_dir = child_errors.take_error_dir()
            stop = lambda *_: sys.exit(child_errors.say(75, "stopped by SIGTERM after step 3.", error_dir))
            signal.signal(signal.SIGTERM, stop)
            if rank == "0":
                time.sleep(0.5)
                os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(120)
        if rank == "1" and how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == "1":
            raise RuntimeError("a bug in rank 1")
        time.sleep(120)

sys.meta_path.insert(0, _Rank())
"""


def torchrun(config: Path) -> int:
    return rehearsal.launch_processes(["train", "never-read.yaml"], config, "ddp", 2)


def accelerate(config: Path) -> int:  # the GPU machines' launcher: accelerate's, for the MULTI_GPU config
    from hftrain.launch.processes import accelerate_processes

    return accelerate_processes(["never-read.yaml"], config, 2)


@pytest.mark.parametrize("launcher", [torchrun, accelerate])
@pytest.mark.parametrize(
    "how, exit_code, said",
    [
        ("refuse", 2, "hftrain: error: the recipe is refused."),
        ("preempt", 75, "hftrain: stopped by SIGTERM after step 3."),
        ("raise", 1, "hftrain: rank 1 failed with exit code 1; its output above says why."),
        ("kill", 128 + signal.SIGKILL, "hftrain: rank 1 was killed by SIGKILL."),
    ],
)
def test_both_launchers_say_how_their_processes_ended_once(
    launcher, how, exit_code, said, tmp_path, monkeypatch, capfd
):
    from hftrain.launch.processes import find_config

    (tmp_path / "sitecustomize.py").write_text(RANK_HOOK, encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("RANK_HOW", how)
    temp = tmp_path / "tmp"  # this process's temporary folders: the launch leaves none (torch's log dir included)
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    environ, handler = dict(os.environ), signal.getsignal(signal.SIGTERM)
    code = launcher(find_config("ddp"))
    captured = capfd.readouterr()
    printed = captured.out + captured.err
    assert code == exit_code, printed[-4000:]
    assert [line for line in printed.splitlines() if line.startswith("hftrain:")] == [said], printed[-4000:]
    assert "ChildFailedError" not in printed and "failed (exitcode" not in printed and "closing signal" not in printed
    assert ("Traceback" in printed and "RuntimeError: a bug in rank 1" in printed) is (how == "raise")  # the rank's own
    assert dict(os.environ) == environ and signal.getsignal(signal.SIGTERM) == handler  # the launcher's own, as before
    assert not list(temp.iterdir())  # was a torchelastic_* folder per launch, never removed


# ------------------------------------------------------------------------------------- the contract, unit by unit
def test_ranks_that_say_the_same_are_printed_once_and_different_ones_with_their_ranks(tmp_path):
    for rank in (1, 0):
        child_errors.write_error(tmp_path, ChildError(rank, 2, "data.readers: 3 readers"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]  # no partial file is left
    errors = child_errors.read_errors(tmp_path)
    assert errors == [ChildError(0, 2, "data.readers: 3 readers"), ChildError(1, 2, "data.readers: 3 readers")]
    assert child_errors.merged_lines(errors) == ["hftrain: error: data.readers: 3 readers"]
    assert child_errors.exit_code_of(errors) == 2

    mixed = [ChildError(0, 2, "A."), ChildError(1, 2, "B."), ChildError(2, 2, "A.")]
    assert child_errors.merged_lines(mixed) == ["hftrain: error: ranks 0, 2: A.", "hftrain: error: rank 1: B."]
    preempted = [
        ChildError(0, 75, "stopped by SIGTERM after step 3"),
        ChildError(1, 75, "stopped by SIGTERM after step 3"),
    ]
    assert child_errors.merged_lines(preempted) == ["hftrain: stopped by SIGTERM after step 3"]
    assert child_errors.exit_code_of(preempted) == 75
    assert child_errors.exit_code_of([ChildError(0, 75, "stopped"), ChildError(1, 2, "refused")]) == 2  # final


def test_the_crash_that_ended_a_launch_is_the_first_not_stopped_by_the_launcher(capsys):
    term, kill = -signal.SIGTERM, -signal.SIGKILL
    assert child_errors.root_failure([(0, term, 5.0), (1, 1, 5.0)]) == (1, 1)  # rank 0 was stopped because of rank 1
    assert child_errors.root_failure([(0, kill, 5.0), (1, term, 5.0)]) == (0, kill)
    assert child_errors.root_failure([(0, 1, 6.0), (1, 3, 5.0)]) == (1, 3)
    assert child_errors.report([], [(0, term, 1.0), (1, kill, 1.0)]) == 137
    assert capsys.readouterr().err == "hftrain: rank 1 was killed by SIGKILL.\n"
    assert child_errors.report([], stopped_by=signal.SIGINT) == 130
    assert capsys.readouterr().err == "hftrain: interrupted\n"
    assert child_errors.report([ChildError(0, 2, "refused.")], [(0, 2, 1.0), (1, term, 1.0)]) == 2
    assert capsys.readouterr().err == "hftrain: error: refused.\n"


def test_the_cli_hands_its_message_to_the_launcher_instead_of_printing_it(tmp_path, monkeypatch, capsys):
    from hftrain.cli import main

    assert main(["train", str(tmp_path / "missing.yaml")]) == 2  # no launcher: printed, as always
    alone = capsys.readouterr().err
    assert alone.startswith("hftrain: error: ") and alone.count("\n") == 1
    monkeypatch.setenv(child_errors.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == ""
    assert child_errors.read_errors(tmp_path) == [ChildError(3, 2, alone.removeprefix("hftrain: error: ").rstrip("\n"))]
    assert child_errors.ERROR_DIR_ENV not in os.environ  # not passed on to what this process starts
