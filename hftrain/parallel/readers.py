"""Logical readers: the run's data order, independent of how many processes and DataLoader workers read it.

A run has L logical readers, fixed at its start (``data.readers``, else the default below) and recorded in
the run directory. Reader r owns an equal share of every source (shares.py: whole shards, a part of every
shard, or every L-th record) and yields its own block stream. The run's global block order is round-robin over the
readers:

    global block g  =  block g // L of reader g % L.

An optimizer step of B sequences takes global blocks [t*B, (t+1)*B). On a launch of P processes x W workers
(P*W must divide L), rank p takes every P-th global block (g % P == p), which are exactly the blocks of the
readers r % P == p; inside the rank, sample k comes from rank reader k % (L/P), and DataLoader worker slot
k % W owns the rank readers i % W == slot. So every launch feeds each optimizer step the same blocks, and a
data position (the consumed global block count plus each reader's own position) restores onto any launch
that divides L. Micro-batch and gradient accumulation only decide how a rank's share of a step is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hftrain.errors import HftrainError

DEFAULT_READERS = 8
STATE_VERSION = 3  # 3: readers take equal shares of unequal shards (shares.py)
# the default shuffle window holds about this many tokens across the run's readers, whatever seq_len: 256 blocks
# per reader at seq_len 2048 with 8 readers, 8,192 at seq_len 64. Memory: 16 MB of int32 tokens for the whole run
# (split over its processes); the first step and a resume tokenize about one window per reader.
SHUFFLE_TOKENS = 1 << 22


def default_readers(reader_limit: int | None, processes: int, workers: int) -> int:
    """Readers for a run that does not set data.readers: 8, or fewer when a source has fewer than 8 shards
    (DataPlan.reader_limit), and always a multiple of processes x workers."""
    base = DEFAULT_READERS if reader_limit is None else max(1, min(DEFAULT_READERS, reader_limit))
    return math.lcm(base, processes * max(workers, 1))


GPU_LOADER_WORKERS = 4  # most DataLoader workers a CUDA process gets by default (see default_workers)


def default_workers(readers: int, processes: int, cpus_per_process: int) -> int:
    """DataLoader workers per process for a CUDA run that leaves training.dataloader_num_workers unset: tokenizing
    in the training process takes host time the GPU then waits for (an H200 at pythia-160m waited for data 5-6% of
    its steps, one window 31%, with none). As many as the process's cores allow beside itself, at most
    GPU_LOADER_WORKERS, at least 1, and a divisor of the process's readers: the default never changes how many
    readers the run has (its data order), a new run's or the one a resumed run recorded."""
    most = max(1, min(GPU_LOADER_WORKERS, cpus_per_process - 1))
    per_rank = max(readers // max(processes, 1), 1)
    return max(w for w in range(1, most + 1) if per_rank % w == 0)


def decide_readers(
    wanted: int | None, recorded: int | None, reader_limit: int | None, processes: int, workers: int
) -> int:
    """The run's reader count: the one recorded at its start (a resumed run), else data.readers, else the default.
    Changing data.readers in the middle of a run is refused: the data order would change."""
    if recorded is not None:
        if wanted is not None and wanted != recorded:
            raise HftrainError(
                f"data.readers: this run started with {recorded} logical readers, and its data order depends on that; "
                f"remove data.readers={wanted} (or set it to {recorded}) to continue, or start a new "
                "training.output_dir."
            )
        return recorded
    return wanted if wanted is not None else default_readers(reader_limit, processes, workers)


def default_window(readers: int, seq_len: int) -> int:
    """Blocks each reader shuffles together when data.shuffle_window is unset: SHUFFLE_TOKENS over all readers.

    Measured (benchmarks/throughput.py, small shape, 40 steps, 8 readers over JSONL shards in corpus order):
    held-out loss 6.60 with 256-block windows (16k tokens per reader: a few neighbouring documents), 6.51 with
    2,048, 6.31 with 4,096 and 6.34 with 8,192, against 6.39 for run_clm's global shuffle."""
    return max(1, -(-SHUFFLE_TOKENS // (readers * seq_len)))


def decide_window(wanted: int | None, recorded: int | None, readers: int, seq_len: int) -> int:
    """The run's shuffle window: recorded at its start (a resumed run), else data.shuffle_window, else the default."""
    if recorded is not None:
        return recorded
    return wanted if wanted is not None else default_window(readers, seq_len)


@dataclass(frozen=True)
class ReaderLayout:
    """The run's data order: L readers, each shuffling windows of `window` blocks, over P processes x W
    DataLoader workers (W = 1 when the rank reads in its main process)."""

    readers: int
    processes: int
    workers: int
    window: int  # blocks each reader shuffles together (1: no shuffling)

    def __post_init__(self) -> None:
        if self.readers % (self.processes * self.workers):
            raise HftrainError(
                f"data.readers: this run reads its data with {self.readers} logical readers (fixed at its start), "
                f"which cannot be split over {self.processes} process(es) x {self.workers} dataloader worker(s). "
                f"{working_launches(self.readers, self.workers)}"
            )

    @property
    def per_rank(self) -> int:
        return self.readers // self.processes

    def rank_readers(self, rank: int) -> list[int]:
        """The readers of one rank, in the order its samples cycle through them."""
        return [rank + self.processes * i for i in range(self.per_rank)]

    def slot_readers(self, rank: int, slot: int, consumed: int) -> list[int]:
        """The readers DataLoader worker slot `slot` of `rank` serves, in the order it serves them, when the rank
        has already taken `consumed` samples: its next sample is rank sample k (the first k >= consumed with
        k % W == slot), from rank reader k % (L/P)."""
        w, per_rank = self.workers, self.per_rank
        k = consumed + (slot - consumed) % w
        first = k % per_rank
        mine = [(first + w * j) % per_rank for j in range(per_rank // w)]
        return [rank + self.processes * i for i in mine]


def working_launches(readers: int, workers: int) -> str:
    """Which process counts can read `readers` readers with `workers` workers each (for messages)."""
    fits = [p for p in range(1, readers + 1) if readers % (p * max(workers, 1)) == 0]
    if fits:
        return (
            f"With {workers} worker(s) per process, {', '.join(map(str, fits))} process(es) work; or change "
            "training.dataloader_num_workers so that processes x workers divides data.readers."
        )
    return "Lower training.dataloader_num_workers so that processes x workers divides data.readers."


def merge_positions(saved: list[dict[str, Any]], layout: ReaderLayout, seq_len: int, where: str) -> dict[str, Any]:
    """One run-wide data position from the per-process files of a checkpoint: the global blocks consumed and
    every reader's own position. Refuses positions this launch cannot continue exactly, saying why."""
    if not saved:
        raise HftrainError(
            f"{where}: the checkpoint holds no data position (it was not written by hftrain); start a new "
            "training.output_dir."
        )
    if any(s.get("version") != STATE_VERSION for s in saved):
        raise HftrainError(
            f"{where}: the data position was saved by another hftrain version, which orders the data differently "
            f"(data order version {saved[0].get('version', 1)}; this "
            f"one reads version {STATE_VERSION}), so this version "
            "cannot continue it exactly. Finish the run with the hftrain version that started it, or start a new "
            "training.output_dir."
        )
    readers = {int(s["readers"]) for s in saved}
    blocks = {int(s["blocks"]) for s in saved}
    if readers != {layout.readers}:
        raise HftrainError(
            f"{where}: the data position was saved with {sorted(readers)[0]} logical readers and this run has "
            f"{layout.readers}. data.readers is fixed at a run's start: keep it, or start a new training.output_dir."
        )
    if {int(s.get("window", layout.window)) for s in saved} != {layout.window}:
        raise HftrainError(
            f"{where}: the data position was saved with shuffle windows of {saved[0]['window']} blocks and this run "
            f"has {layout.window}; set data.shuffle_window: {saved[0]['window']} to resume."
        )
    if {int(s["seq_len"]) for s in saved} != {seq_len}:
        raise HftrainError(
            f"{where}: the data position was saved with another data.seq_len; "
            f"keep data.seq_len={saved[0]['seq_len']} to resume."
        )
    if len(blocks) != 1:
        raise HftrainError(
            f"{where}: the processes' data positions disagree ({sorted(blocks)} "
            "blocks consumed); the checkpoint is inconsistent."
        )
    (consumed,) = blocks
    if consumed % layout.processes:
        raise HftrainError(
            f"{where}: {consumed} blocks were consumed, which {layout.processes} processes cannot continue evenly "
            "(the global batch must be a multiple of the process count)."
        )
    positions: dict[str, Any] = {}
    for s in saved:
        positions.update(s["positions"])
    return {"blocks": consumed, "positions": positions}


def rank_state(
    layout: ReaderLayout, rank: int, consumed_by_rank: int, positions: dict[str, Any], seq_len: int
) -> dict[str, Any]:
    """What one process writes into a checkpoint: its readers' positions and the run-wide block count."""
    return {
        "version": STATE_VERSION,
        "readers": layout.readers,
        "blocks": consumed_by_rank * layout.processes,
        "processes": layout.processes,
        "workers": layout.workers,
        "seq_len": seq_len,
        "window": layout.window,
        "positions": {r: p for r, p in positions.items() if int(r) % layout.processes == rank},
    }
