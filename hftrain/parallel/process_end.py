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
"""

from __future__ import annotations

import atexit
import os
import sys

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
