"""How a process of a multi-process run ends: every process leaves training together, and none tears down its
process group.

Tearing down a gloo process group can deadlock. Its destructor joins gloo's worker threads while the caller holds
Python's GIL (destroy_process_group, DDP's reducer dropping the last reference, or interpreter finalization), and
a worker still releasing the last collective may need the GIL itself: a barrier keeps the collectives before it
(an evaluation's all-gather), whose tensors were made in Python and are freed with it. Seen in CI, a rank of a
finished 2-process run hung for good with ``~ProcessGroupGloo`` joining in the main thread and
``AsyncBarrierWork``'s destructor waiting for the GIL in gloo's thread (the class of pytorch/pytorch#56297).
Whether it happens is a race (more likely on a busy machine), so waiting cannot settle it; not tearing down does.

So ``leave_training`` only waits at a barrier, and ``end_after_exit_handlers``, registered first by the program
(cli/__init__.py) in each launched process and so run last among the exit handlers, ends a process whose process group
is still there with ``os._exit``: after every other exit handler (trackers, TensorBoard) and with its output flushed,
before interpreter finalization would destroy the group. A process that never joined a group ends as usual.

And nothing hftrain starts outlives the process that started it (Linux: the kernel's parent-death signal,
prctl(PR_SET_PDEATHSIG)). A killed command (kill -9, an OOM kill of the launcher, a closed terminal) once left its
ranks training into the output directory without its lock, and a prepare's pool workers writing shards:
``register`` makes a launched rank receive SIGTERM when its launcher dies (it saves a checkpoint at the next step
and stops, as on a preemption), and ``children_end_with_this_process`` makes every child this process forks from
its main thread (a pool worker, a DataLoader worker) receive SIGKILL when it dies.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any

_exit = {"code": 1, "registered": False}  # the program's exit code (1 until main returns: an exception escaped)


def leave_training() -> None:
    """Every process has finished training (a barrier); the process group stays until the process ends."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def register() -> None:
    """At the start of a launched process (torchrun's LOCAL_RANK set): `end_after_exit_handlers` runs after every
    exit handler registered later. Elsewhere (a launcher, one process, a test calling the program) nothing."""
    if "LOCAL_RANK" in os.environ and not _exit["registered"]:
        atexit.register(end_after_exit_handlers)
        _exit["registered"] = True
        end_with_parent(signal.SIGTERM, os.environ.get(LAUNCHER_PID_ENV))
    children_end_with_this_process()


LAUNCHER_PID_ENV = "HFTRAIN_LAUNCHER_PID"  # set by hftrain's launcher for the processes it starts (child_errors.py)
_PR_SET_PDEATHSIG = 1
_forks: dict[str, Any] = {"hooked": False, "from_main": False, "parent": 0}


def end_with_parent(sig: int, parent: str | None = None) -> bool:
    """This process receives `sig` when its parent ends (Linux; elsewhere nothing). `parent`: the pid of the
    process it ends with (its launcher), when known: if that one has already ended, the signal is sent at once (the
    kernel's signal only follows the parent that is there when it is set). Returns whether it is set."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent and parent.isdigit() and not _alive(int(parent)):  # it ended before the signal was set
        os.kill(os.getpid(), sig)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's: alive
        return True
    return True


def children_end_with_this_process() -> None:
    """Every child this process forks from its main thread ends (SIGKILL) when this process ends. A thread's fork
    is left alone: the kernel's signal follows the thread that forked, which may end long before the process."""
    if _forks["hooked"] or not hasattr(os, "register_at_fork"):
        return
    _forks["hooked"] = True

    def before() -> None:
        _forks["from_main"] = threading.current_thread() is threading.main_thread()
        _forks["parent"] = os.getpid()

    def in_child() -> None:  # the parent may have died before this ran: end_with_parent looks
        if _forks["from_main"]:
            end_with_parent(signal.SIGKILL, str(_forks["parent"]))

    os.register_at_fork(before=before, after_in_child=in_child)


def set_exit_code(code: int | None) -> None:
    _exit["code"] = 0 if code is None else code if isinstance(code, int) else 1


def end_after_exit_handlers() -> None:
    """With a process group still there: flush the output and end now, without interpreter finalization."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_exit["code"])
