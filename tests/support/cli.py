"""Running hftrain as a user would: `python -m hftrain ...` in a subprocess, from the repository root; or, where no
process boundary is under test, the CLI's own entry point inside the test process (`in_process`: the same parsing,
messages and exit codes, without 10-20 s of imports per start)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]  # the repository root

# What accelerate must really set up for each shipped backend (a silent fallback to DDP or one process fails).
EXPECTED_TYPE = {"ddp": "MULTI_CPU", "fsdp": "FSDP", "zero3": "DEEPSPEED"}


def run_cli(
    *args: str, cwd: Path = ROOT, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m hftrain ARGS` as a user would, capturing output. One that runs past `timeout` fails the test
    with where it was: its process group gets SIGABRT, on which Python's faulthandler (on here) prints every
    thread's stack, then SIGKILL; the test shows the end of its output (a training rank's own stall report,
    parallel/liveness.py, comes sooner)."""
    full_env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
    argv = [sys.executable, "-m", "hftrain", *args]
    with subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
        preexec_fn=_no_core_file,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = _stacks_then_stop(process)
            raise AssertionError(
                f"`hftrain {' '.join(args)}` ran past {timeout} s.\n--- stdout (end) ---\n{out[-12000:]}\n--- stderr "
                f"(end) ---\n{err[-12000:]}"
            ) from None
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _no_core_file() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGABRT's default action would write a core file


def _stacks_then_stop(process: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to the hung command's process group (faulthandler prints each thread's stack), SIGKILL a few
    seconds later; what it printed, as far as it comes."""
    import signal

    for sig, wait in ((signal.SIGABRT, 5), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return process.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", "(its output did not close: a process outside its group holds it)"


def in_process(capsys, *argv: str) -> tuple[int, str]:
    """`hftrain ARGV` through `hftrain.cli.main` in this process: (exit status, what it printed, stderr first).
    An exception other than hftrain's one-line error escapes `main` and fails the test, as a traceback would in a
    terminal; argparse's own refusals (SystemExit) give their status."""
    from hftrain import network
    from hftrain.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    finally:
        network.configure()  # a recipe's faults.network_timeout_s ends with its command
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def run_in_process(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, exact_env: bool = False
) -> subprocess.CompletedProcess:
    """run_cli's result for `hftrain ARGS` run through `hftrain.cli.main` in this process (from `cwd`, with `env`
    added to the environment while it runs, or as the whole environment with `exact_env`): for commands whose
    process boundary is not under test."""
    import contextlib
    import io

    from hftrain import network
    from hftrain.cli import main

    out, err, before, here = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    if exact_env:
        os.environ.clear()
    os.environ.update(env or {})
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(before)
        network.configure()  # a recipe's faults.network_timeout_s ends with its command
    return subprocess.CompletedProcess(["hftrain", *args], code, out.getvalue(), err.getvalue())


def messages(stderr: str) -> list[str]:
    """stderr's lines without hftrain's start-up narration ("hftrain: reading the recipe's schema ..." on a slow
    or cold machine; hftrain/progress.py), which may come before a command's one message."""
    from hftrain.progress import is_narration

    return [line for line in stderr.strip().splitlines() if not is_narration(line)]


def launch(recipe: Path, backend: str, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`hftrain train RECIPE` with 2 processes on `backend` into `out`; asserts it succeeded."""
    result = run_cli(
        "train", str(recipe), "--accelerate-config", backend, "--nproc", "2", f"training.output_dir={out}", *overrides
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def in_background(call: Callable[[], T]) -> Future[T]:
    """Start `call`, an independent run, now; `.result()` waits for it and raises what it raised. For runs whose
    results a test checks, never their timing: on 2 cores a run that imports (one core) or waits leaves room for
    another, so two short runs together take little more than the longer one. Not for two long compute-bound
    runs: a single-process run's threads use every core, and two of them at once took 101 s where one after the
    other took 37."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="in_background")
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def selected_params(request, test_name: str) -> list[dict]:
    """The parameters of every case of `test_name` (in the requesting module) this session will run: what a
    module fixture starts at once, in_background, so that deselected cases cost nothing."""
    return [
        item.callspec.params
        for item in request.session.items
        if item.module is request.module and item.originalname == test_name
    ]


def kill_family(proc: subprocess.Popen) -> None:
    """SIGKILL a launched run's every process at once (the launcher, torchrun and the ranks): no handler runs."""
    import signal

    import psutil

    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def kill_at_checkpoint(cmd: list[str], run_dir: Path, step: int, timeout: float = 300) -> Path:
    """Start `cmd` (a training run into `run_dir`), kill it with SIGKILL once a checkpoint at `step` or later is
    complete, and return the latest complete checkpoint the kill left (the run must not have finished)."""
    import time

    from hftrain.checkpoint import manager as ckpt
    from hftrain.checkpoint.layout import RunLayout

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while not any(ckpt.checkpoint_step(c) >= step for c in ckpt.complete_checkpoints(run_dir)):
        assert proc.poll() is None and time.time() < deadline, f"the run ended before its step-{step} checkpoint"
        time.sleep(0.05)
    kill_family(proc)
    assert not RunLayout(run_dir).final.exists(), "the run finished before the kill: nothing was resumed"
    survivor = ckpt.latest_checkpoint(run_dir)
    assert survivor is not None
    return survivor
