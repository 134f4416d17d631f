"""What hftrain's launcher and the processes it starts agree on, so that a refusal is said once, with its exit code.

Before, an HftrainError raised in the ranks of `hftrain train --accelerate-config` was printed once per rank, then
torchrun printed its ChildFailedError traceback and exited 1, which `--max-restarts` restarted although the same
recipe fails the same way again. Now `launch` runs torchrun's (or accelerate's) launcher in this process, with a
directory named in HFTRAIN_ERROR_DIR. A rank that ends with a message for the user (cli/__init__.py: an
HftrainError, a preemption, an interrupt) writes {rank, exit_code, message} there instead of printing it; after
the launch each distinct message is printed once and the launcher exits with the ranks' code (2, 75, 130).
A rank that crashes (a bug, a signal) prints its own traceback; the launcher names the rank and how it ended.
Without the variable (a plain `accelerate launch -m hftrain train`) a process prints its message as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hftrain import _compat

ERROR_DIR_ENV = "HFTRAIN_ERROR_DIR"
ELASTIC_ENV = "HFTRAIN_ELASTIC_NODES"  # MIN:MAX nodes, set for the processes of an elastic launch (launch/multinode.py)
MEMORY_WARNED_ENV = (
    "HFTRAIN_MEMORY_WARNED"  # set by `hftrain train --accelerate-config` for its processes: the fit warned once
)
USER_ERROR = 2  # cli/__init__.py: "hftrain: error: MESSAGE"
UNREACHABLE = 69  # EX_UNAVAILABLE: the other nodes did not join, or the head node cannot be reached (a restart may)
# torch elastic's own lines about a failed worker and the workers it then stops; report() says it in one line
_TORCH_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_TORCH_LINES = ("failed (exitcode", "Sending process")


@dataclass(frozen=True)
class ChildError:
    """What one process said when it ended: its global rank, exit code and message (without "hftrain: ")."""

    rank: int
    exit_code: int
    message: str


# ------------------------------------------------------------------------------------------ in the processes
_taken: list[Path | None] = [None]


def take_error_dir() -> Path | None:
    """The launcher's error directory, or None. It leaves the environment, so that a process this one starts does
    not write into it (error_dir() still gives it, to this process's threads)."""
    value = os.environ.pop(ERROR_DIR_ENV, None)
    _taken[0] = Path(value) if value else _taken[0]
    return _taken[0] if value else None


def error_dir() -> Path | None:
    """The error directory this process took from its launcher, if any."""
    return _taken[0]


def say(exit_code: int, message: str, error_dir: Path | None = None) -> int:
    """Print `message` as hftrain's one line, or hand it to the launcher when there is one; returns `exit_code`."""
    if error_dir is not None:
        try:
            write_error(error_dir, ChildError(int(os.environ.get("RANK", "0")), exit_code, message))
            return exit_code
        except (OSError, ValueError):  # the launcher is gone: say it here
            pass
    print(line(exit_code, message), file=sys.stderr, flush=True)
    return exit_code


def write_error(directory: Path, error: ChildError) -> Path:
    """rank-R.json, written whole or not at all (a temporary file renamed into place)."""
    fd, partial = tempfile.mkstemp(dir=directory, prefix=f".rank-{error.rank}-", suffix=".partial")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(asdict(error), f)
    path = directory / f"rank-{error.rank}.json"
    os.replace(partial, path)
    return path


# ------------------------------------------------------------------------------------------ in the launcher
def read_errors(directory: Path, pattern: str = "rank-*.json") -> list[ChildError]:
    errors = []
    for path in directory.glob(pattern):
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            errors.append(ChildError(int(raw["rank"]), int(raw["exit_code"]), str(raw["message"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(errors, key=lambda e: e.rank)


def line(exit_code: int, message: str, ranks: Sequence[int] = ()) -> str:
    """hftrain's one line for a message: `hftrain: error: MESSAGE` for a user error, `hftrain: MESSAGE` otherwise."""
    where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: " if ranks else ""
    return f"hftrain: {'error: ' if exit_code == USER_ERROR else ''}{where}{message}"


def merged_lines(errors: Sequence[ChildError]) -> list[str]:
    """One line per distinct message; the ranks are named only when the ranks said different things."""
    ranks: dict[tuple[int, str], list[int]] = {}
    for error in errors:
        ranks.setdefault((error.exit_code, error.message), []).append(error.rank)
    if len(ranks) == 1:
        return [line(code, message) for code, message in ranks]
    return [line(code, message, sorted(who)) for (code, message), who in ranks.items()]


def exit_code_of(errors: Sequence[ChildError]) -> int:
    """2 when any rank refused the run (a restart fails the same way), else the lowest rank's code."""
    codes = [e.exit_code for e in errors]
    return USER_ERROR if USER_ERROR in codes else codes[0]


def root_failure(failed: Sequence[tuple[int, int, float]]) -> tuple[int, int]:
    """(rank, exit code) of the failure that ended the launch, from (rank, exit code, time) of each failed process:
    the first one not stopped by the launcher's SIGTERM (the others got it after it); a signal is a negative code."""
    causes = [f for f in failed if f[1] != -signal.SIGTERM] or list(failed)
    rank, code, _ = min(causes, key=lambda f: (f[2], f[0]))
    return rank, code


def report(
    errors: Sequence[ChildError],
    failed: Sequence[tuple[int, int, float]] = (),
    stopped_by: int | None = None,
    said: Collection[str] = (),
) -> int:
    """Print how the launch ended, once, and return its exit code. `failed`: (rank, exit code, time) of the processes
    that failed; `stopped_by`: the signal this launcher received (torch elastic passed it on to the processes);
    `said`: lines already printed (LiveErrors)."""
    if errors:
        texts, code = merged_lines(errors), exit_code_of(errors)
    elif stopped_by is not None:
        said = "interrupted" if stopped_by == signal.SIGINT else f"stopped by {_signal_name(stopped_by)}"
        texts, code = [f"hftrain: {said}"], 128 + stopped_by
    elif failed:
        rank, code = root_failure(failed)
        if code > 0:
            texts = [f"hftrain: rank {rank} failed with exit code {code}; its output above says why."]
        else:
            texts, code = [f"hftrain: rank {rank} was killed by {_signal_name(-code)}."], 128 - code
    else:
        return 0
    for text in texts:
        if text not in said:
            print(text, file=sys.stderr, flush=True)
    return code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launch(start: Callable[[], Any], env: Mapping[str, str], launcher_args: Any = None) -> int:
    """Run `start` (torchrun's or accelerate's launcher, in this process, so that its failure is an exception here
    and not a traceback) with `env` added to the environment the processes start with; returns the exit code of
    the launch after report() has said how it ended. This process's environment is left as it was. An elastic
    launch (multinode.py) restarts its processes after a failure: what they said is printed as it comes
    (LiveErrors), and a launch that finished after restarts exits 0. `launcher_args`: the launcher's parsed
    arguments; without a log_dir of their own, torch's goes in this launch's folder and leaves with it (by default
    torch makes a /tmp/torchelastic_* per launch and never removes it)."""
    from subprocess import CalledProcessError

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    directory = Path(tempfile.mkdtemp(prefix="hftrain-errors-"))
    failed: list[tuple[int, int, float]] = []
    stopped_by = None
    live = LiveErrors(directory) if env.get(ELASTIC_ENV) else None
    if launcher_args is not None and not getattr(launcher_args, "log_dir", None):
        launcher_args.log_dir = str(directory / "launcher-logs")
    try:
        from hftrain.parallel.process_end import LAUNCHER_PID_ENV

        launcher = {LAUNCHER_PID_ENV: str(os.getpid())}  # the ranks end with this process (process_end.py)
        children = {**env, ERROR_DIR_ENV: str(directory), **launcher, **_compat.launch_environment_cpp_logs()}
        with _environment(children), _signal_handlers_kept(), _torch_lines_quiet(), _preemption_passed_on():
            try:
                start()
            except ChildFailedError as err:
                failed = [(rank, f.exitcode, f.timestamp) for rank, f in err.failures.items()]
            except SignalException as err:  # torch elastic stopped the processes with the same signal
                stopped_by = int(err.sigval)
            except CalledProcessError as err:  # accelerate's launcher of one process
                failed = [(0, err.returncode or 1, 0.0)]
            except SystemExit as err:  # accelerate 1.16+ turns torch elastic's SignalException into an exit
                failed, stopped_by = _launcher_exit(err)
            except Exception as err:  # several nodes: the others never joined (a bounded wait, multinode.py)
                if type(err).__name__ not in _RENDEZVOUS_FAILURES:
                    raise
                return _rendezvous_failed(err)
        if live is None:
            return report(read_errors(directory), failed, stopped_by)
        errors = live.stop()
        return report(errors, failed, stopped_by, live.said) if failed or stopped_by is not None else 0
    finally:
        if live is not None:
            live.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _launcher_exit(err: SystemExit) -> tuple[list[tuple[int, int, float]], int | None]:
    """(failed, stopped_by) of a launcher that exited instead of raising: accelerate 1.16's `_run_torchrun` exits
    128 + N for torch elastic's SignalException (its processes already stopped) and 130 for KeyboardInterrupt,
    where earlier releases raised them. Read as the exceptions were, the launch says the same on every release."""
    code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    if code > 128 and code - 128 in signal.valid_signals():
        return [], code - 128
    return ([(0, code, 0.0)] if code else []), None


class LiveErrors:
    """An elastic launch's messages, printed as the processes write them (once each; torchrun may restart the
    processes after it, so the end of the launch is too late). stop() returns the ones of the last failure."""

    def __init__(self, directory: Path, every_s: float = 0.5):
        self.directory, self.said, self.latest = directory, set(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every_s,), name="hftrain-errors", daemon=True)
        self._thread.start()

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.poll()

    def poll(self) -> None:
        taken = []
        for path in sorted(self.directory.glob("rank-*.json")):
            seen = path.with_suffix(".seen")
            try:
                os.replace(path, seen)  # a later write by the same rank makes a new rank-R.json
            except OSError:
                continue
            taken.extend(read_errors(self.directory, seen.name))
            seen.unlink(missing_ok=True)
        if taken:
            self.latest = taken
            for text in merged_lines(taken):
                if text not in self.said:
                    self.said.add(text)
                    print(text, file=sys.stderr, flush=True)

    def stop(self) -> list[ChildError]:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=5)
            self.poll()
        return self.latest


_RENDEZVOUS_FAILURES = {
    "DistStoreError",
    "DistNetworkError",
    "RendezvousTimeoutError",
    "RendezvousError",
    "RendezvousClosedError",
}


def _rendezvous_failed(err: Exception) -> int:
    said = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
    if type(err).__name__ == "RendezvousClosedError":
        print(
            "hftrain: the elastic run this node was started for has ended (its rendezvous is closed: the other nodes "
            "finished, or stopped after their last restart); this node did not train.",
            file=sys.stderr,
            flush=True,
        )
        return UNREACHABLE
    if os.environ.get(ELASTIC_ENV):
        least = os.environ[ELASTIC_ENV].split(":")[0]
        print(
            f"hftrain: fewer than {least} node(s) joined the elastic rendezvous, or its head node went away ({said}). "
            "Start the same script on every node with the same HEAD_NODE and MASTER_PORT (a node that stays up, and a "
            "port free there), or give them longer with --rendezvous-timeout.",
            file=sys.stderr,
            flush=True,
        )
        return UNREACHABLE
    print(
        f"hftrain: the nodes did not all join the rendezvous ({said}). Start the same script on every node, each "
        f"with its own NODE_RANK and the same HEAD_NODE and MASTER_PORT (node 0's address and a port free there), or "
        "give them longer with --rendezvous-timeout.",
        file=sys.stderr,
        flush=True,
    )
    return UNREACHABLE


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `values` while the launcher starts processes (torch elastic copies os.environ for each);
    afterwards exactly as before, whatever the launchers set meanwhile (torchrun sets OMP_NUM_THREADS)."""
    before = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """torch elastic sets handlers for the signals it forwards to the processes and leaves them set: put ours back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    signals = {
        getattr(signal, n.strip()) for n in names if isinstance(getattr(signal, n.strip(), None), signal.Signals)
    }
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _preemption_passed_on() -> Iterator[None]:
    """SIGUSR1 (SLURM's warning before a preemption, `--signal=B:USR1@180`) to this launcher goes on to the processes
    it started, which save a checkpoint and exit 75 (training/step_faults.py) for report() to pass on. Before, the
    launcher died of it (USR1's default action) while its processes saved, and SLURM saw a signal, not 75. Only
    the direct children (the ranks) get it: their DataLoader workers are theirs to stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import psutil

    def forward(signum: int, _frame: object) -> None:
        for child in psutil.Process().children(recursive=False):
            try:
                child.send_signal(signum)
            except psutil.Error:
                pass

    previous = signal.signal(signal.SIGUSR1, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


class _TorchFailureLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TORCH_LINES)


@contextlib.contextmanager
def _torch_lines_quiet() -> Iterator[None]:
    """Without torch elastic's "failed (exitcode: 2) local_rank: 0 ..." and "Sending process ... closing signal"
    lines: report() names the failed rank and its exit itself (a crashed rank still prints its own traceback)."""
    logger, quiet = logging.getLogger(_TORCH_LOGGER), _TorchFailureLines()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
