"""One launch owns an output directory while it works (hftrain/checkpoint/output_lock.py): an independent second
launch is refused naming the holder; the processes of the same launch join; a holder killed with SIGKILL is
taken over at once; on S3 the same through a conditional write."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hftrain.checkpoint.output_lock import LOCK_FILE, RUN_TOKEN_ENV, owning
from hftrain.errors import HftrainError

from ..support.cli import ROOT


def hold(
    where: str | Path, key: str = "training.output_dir", env: dict[str, str] | None = None, *options: str
) -> subprocess.Popen:
    """Another process that owns `where` until killed (tests/support/lock_holder.py)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.lock_holder", str(where), key, *options],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    if line.startswith("child "):
        proc.child = int(line.split()[1])  # type: ignore[attr-defined]
        line = proc.stdout.readline()
    assert line.strip() == "held", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.fixture
def own_token(monkeypatch):
    for name in (RUN_TOKEN_ENV, "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_an_independent_process_is_refused_naming_the_holder(tmp_path, own_token):
    holder = hold(tmp_path / "run")
    try:
        started = time.monotonic()
        with pytest.raises(HftrainError) as refused:
            with owning(tmp_path / "run", "training.output_dir"):
                pass
        assert time.monotonic() - started < 2  # no waiting for a live holder
        text = str(refused.value)
        assert text.startswith(
            f"training.output_dir: {tmp_path / 'run'} is in use by another hftrain process: "
            f"pid {holder.pid} on {socket.gethostname()} (`lock_holder.py "
        )
        assert "Wait for it to finish or stop it, or give training.output_dir another directory." in text
    finally:
        holder.kill()
        holder.wait()


def test_the_processes_of_one_launch_join_and_a_killed_holder_is_taken_over_at_once(tmp_path, own_token):
    """Same token (a rank, a --max-restarts restart): joins. The holder SIGKILLed: the next launch owns it at once."""
    holder = hold(tmp_path / "run", env={RUN_TOKEN_ENV: "launch-1"})
    try:
        os.environ[RUN_TOKEN_ENV] = "launch-1"
        with owning(tmp_path / "run", "training.output_dir"):
            pass  # joined: no error
        del os.environ[RUN_TOKEN_ENV]
        with pytest.raises(HftrainError, match="is in use by another hftrain process"):
            with owning(tmp_path / "run", "training.output_dir"):
                pass
    finally:
        os.environ.pop(RUN_TOKEN_ENV, None)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    started = time.monotonic()
    with owning(tmp_path / "run", "training.output_dir"):
        assert RUN_TOKEN_ENV in os.environ  # what the processes it starts inherit
        with owning(tmp_path / "run", "training.output_dir"):
            pass  # re-entrant within a process (the CLI holds it, then train() in the same process)
    assert time.monotonic() - started < 1 and RUN_TOKEN_ENV not in os.environ
    assert (tmp_path / "run" / LOCK_FILE).read_bytes() == b""  # released: says no holder


def test_ranks_of_one_torchrun_launch_share_a_token_without_a_launcher(tmp_path, own_token, monkeypatch):
    """`accelerate launch -m hftrain train` with no hftrain launcher above it: torchrun's run id and rendezvous
    address are the same on every rank and node."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    holder = hold(tmp_path / "run")  # rank 0 of that launch, say
    try:
        with owning(tmp_path / "run", "training.output_dir"):
            pass
        monkeypatch.setenv("MASTER_PORT", "29501")  # another launch
        with pytest.raises(HftrainError, match=f"pid {holder.pid} on"):
            with owning(tmp_path / "run", "training.output_dir"):
                pass
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_s3_prefix_is_owned_through_a_conditional_write(s3, own_token):
    bucket = s3.make_bucket()
    url = f"s3://{bucket}/tokenized/run"
    holder = hold(url, "--out")
    try:
        with pytest.raises(HftrainError) as refused:
            with owning(url, "--out"):
                pass
        assert f"--out: {url} is in use by another hftrain process: pid {holder.pid}" in str(refused.value)
        assert f"(if it is gone, delete {url}/{LOCK_FILE})" in str(refused.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with owning(url, "--out"):  # its holder died on this host: taken over
        assert b'"pid": %d' % os.getpid() in s3.get(f"{url}/{LOCK_FILE}")
    with pytest.raises(Exception):
        s3.get(f"{url}/{LOCK_FILE}")  # released: the object is gone


def _gone(pid: int, within_s: float = 10.0) -> bool:
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_the_lock_is_held_by_the_processes_that_write_not_only_their_launcher(tmp_path, own_token):
    """Issue 63 class 1: a launcher killed with SIGKILL (an OOM kill, a closed terminal) while a process it started
    still writes: a new launch is refused until that one ends (before: accepted, and both wrote one directory)."""
    launcher = hold(tmp_path / "run", env={RUN_TOKEN_ENV: "launch-1"})
    rank = hold(tmp_path / "run", env={RUN_TOKEN_ENV: "launch-1"})  # joins: the same launch
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        with pytest.raises(HftrainError, match="its launcher has ended, but processes it started still write there"):
            with owning(tmp_path / "run", "training.output_dir"):
                pass
    finally:
        rank.kill()
        rank.wait()
    with owning(tmp_path / "run", "training.output_dir"):
        pass  # the last writer gone: taken over at once


def test_a_forked_child_neither_keeps_the_lock_nor_outlives_its_parent(tmp_path, own_token):
    """Issue 63 class 1: kill -9 of a prepare left its pool workers running and holding the folder's lock (an
    inherited flock): the same command was refused for minutes, naming a pid already dead."""
    holder = hold(tmp_path / "out", "--out", None, "--fork")
    child = holder.child  # type: ignore[attr-defined]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _gone(child), f"the forked child {child} outlived its parent"
    started = time.monotonic()
    with owning(tmp_path / "out", "--out"):
        pass
    assert time.monotonic() - started < 2
