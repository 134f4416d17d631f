"""`hftrain data prepare` on every core: each input shard (a file of a source) is one unit of work.

A worker process reads its unit, tokenizes (cutting long documents where tokens do not change, stream.py) and
packs it into its own output shards; the few tokens after its last whole block come back to the main process,
which packs all the units' tails, in unit order, into the last shards. Every unit is done the same way whatever
the process count, so the output is the same on 1 process or 64. Held-out documents keep their identity
(source, shard, record), so training and validation stay disjoint exactly as when streaming.

Workers are spawned (not forked: the tokenizer's own thread pool does not survive a fork), each on one core
(TOKENIZERS_PARALLELISM=false there); at most 2 x processes units are in flight, and each reports its
progress (bytes read, tokens packed) on a queue.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from hftrain.data.chunking import SafeCut, TokenRun, text_batches
from hftrain.data.loader import train_documents
from hftrain.data.pretokenized import ShardWriter
from hftrain.errors import HftrainError

Unit = tuple[int, int]  # (source, shard)
REPORT_EVERY_S = 1.0


@dataclass
class PrepareJob:
    """What every worker needs (pickled once per worker process)."""

    plan: Any  # loader.DataPlan
    tokenizer: Any
    out: str
    shard_bytes: int
    options: dict[str, Any]


@dataclass
class UnitResult:
    unit: Unit
    shards: list[dict[str, Any]]
    tail: np.ndarray  # tokens after the last whole block
    skipped: int  # bad records skipped (data.on_bad_record=skip)


def prepare_unit(job: PrepareJob, unit: Unit, report: Callable[[Unit, int, int], None]) -> UnitResult:
    """Tokenize and pack one input shard into its own output shards; `report(unit, bytes_read, tokens)`."""
    section, tok = job.plan.section, job.tokenizer
    docs = train_documents(job.plan, loop=False)
    docs.shuffle, docs.only = False, unit
    source, shard = unit
    writer = ShardWriter(job.out, section.seq_len, tok, job.shard_bytes, job.options, prefix=f"train-s{source}-{shard:05d}")
    tokens, eos = TokenRun([], np.int32 if len(tok) < 2**31 else np.int64), int(tok.eos_token_id)
    state, last = docs.fresh_state(), time.perf_counter()
    for texts, ends in text_batches(docs.pieces(state), SafeCut(tok)):
        ids = tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        for seq, end in zip(ids, ends):
            tokens.add(seq, eos if end else None)
        for block in tokens.take_blocks(section.seq_len):
            writer.add(block)
        if time.perf_counter() - last > REPORT_EVERY_S:
            last = time.perf_counter()
            report(unit, state["cursors"][source]["pos"][0], writer.blocks * section.seq_len)
    return UnitResult(unit, writer.close(), tokens.rest(), docs.bad.skipped)


_JOB: Any = None
_QUEUE: Any = None


def _start(job: PrepareJob, queue: Any) -> None:
    global _JOB, _QUEUE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _JOB, _QUEUE = job, queue


def _run(unit: Unit) -> UnitResult:
    return prepare_unit(_JOB, unit, lambda u, read, tokens: _QUEUE.put((u, read, tokens)))


def run_units(job: PrepareJob, units: list[Unit], processes: int, report: Callable[[Unit, int, int], None]) -> Iterator[UnitResult]:
    """Each unit's result, in unit order, done on `processes` processes (1: here)."""
    if processes <= 1 or len(units) <= 1:
        for unit in units:
            yield prepare_unit(job, unit, report)
        return
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_start, initargs=(job, queue)) as pool:
        pending: deque[Any] = deque()
        todo = iter(units)
        try:
            while True:
                while len(pending) < 2 * processes and (unit := next(todo, None)) is not None:
                    pending.append(pool.submit(_run, unit))
                if not pending:
                    return
                while not pending[0].done():
                    _drain(queue, report, wait=0.2)
                _drain(queue, report, wait=0)
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise HftrainError(
                "data prepare: a worker process died (out of memory, or a script that starts processes without "
                '`if __name__ == "__main__":` around its own code). Run with --processes 1, or guard the script.'
            ) from None


def _drain(queue: Any, report: Callable[[Unit, int, int], None], wait: float) -> None:
    import queue as queues

    try:
        item = queue.get(timeout=wait) if wait else queue.get_nowait()
        while True:
            report(*item)
            item = queue.get_nowait()
    except queues.Empty:
        return
