"""Flags a step raises on one process act on every process at the same step (hftrain/training/step_faults.py): two
gloo processes, one sees a non-finite loss, the other a signal."""

from __future__ import annotations

import multiprocessing
import socket

import torch

from hftrain.training.step_faults import NONFINITE, NORM, READ_EVERY, StepFlags

BAD_ON_RANK_1, SIGNAL_ON_RANK_0, STEPS = 3, 4, 7


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        flags, seen = StepFlags("cpu", 2), []
        for step in range(1, STEPS + 1):
            bad = torch.tensor(rank == 1 and step == BAD_ON_RANK_1)
            flags.signal = flags.signal or (rank == 0 and step == SIGNAL_ON_RANK_0)
            found_inf = float(flags.of_step(step, bad, torch.tensor(2.5))[NONFINITE])  # what the fused optimizer gets
            acts = flags.staged_signal()  # the previous step's agreement, as PreemptionCallback reads it
            flags.stage_signal(step)
            seen.append((step, found_inf, acts))
        results.put((rank, seen, flags.read(STEPS)))
    finally:
        dist.destroy_process_group()


def test_a_flag_on_one_process_acts_on_both_at_the_same_step():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict((rank, (seen, read)) for rank, seen, read in (results.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    assert got[0] == got[1]  # every process: the same skips, the same stop step, the same reads
    seen, read = got[0]
    assert [step for step, found_inf, _ in seen if found_inf] == [BAD_ON_RANK_1]  # skipped on the device by both
    assert [step for step, _, acts in seen if acts] == [
        SIGNAL_ON_RANK_0 + 1,
        SIGNAL_ON_RANK_0 + 2,
        SIGNAL_ON_RANK_0 + 3,
    ]
    assert [(step, values[NONFINITE], values[NORM]) for step, values in read if values[NONFINITE]] == [
        (BAD_ON_RANK_1, 1.0, 2.5)
    ]
    assert len(read) == STEPS


def test_reads_come_where_the_trainer_reads_or_every_read_every_steps():
    flags = StepFlags("cpu")
    flags.of_step(1, torch.tensor(False))
    assert not flags.due(1, trainer_reads=False) and flags.due(1, trainer_reads=True)
    assert flags.due(READ_EVERY, trainer_reads=False)
    assert [step for step, _ in flags.read(1)] == [1] and not flags.due(2, trainer_reads=True)  # nothing pending
