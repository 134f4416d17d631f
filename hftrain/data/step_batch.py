"""Any step's batch on demand (`hftrain data batch RECIPE_OR_RUN --step N`), and what training consumed (data.
record_batches): the same sequences, named the same way, so that one can be checked against the other.

A run's global block order (parallel/readers.py) is round-robin over its L logical readers, and step s of a global
batch B takes global blocks [B·s, B·(s+1)): block g is block g // L of reader g % L. So a step's batch is rebuilt from
the recipe's data plan and the run's layout (B, L, the shuffle window, training.seed) alone, on any machine. A stored
order (stored_rows.py) starts each reader at its block at once; every other source is read from its start up to the
step (a reader's stream has no index to seek by), which takes as long as training took to read that far.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from hftrain.data.loader import DataPlan, train_blocks
from hftrain.data.stored_rows import StoredRow
from hftrain.data.stream import Worker
from hftrain.errors import HftrainError


@dataclass(frozen=True)
class BatchLayout:
    """What decides which sequences a step trains on, beside the data plan: sequences per step, logical readers and
    the blocks each shuffles together."""

    global_batch: int
    readers: int
    window: int


def sequence_tokens(block: Any) -> np.ndarray:
    """The token ids that name a sequence: a stored row whole (seq_len + 1), a text block, an instruction block's
    inputs, a preference pair's prompt, chosen and rejected ids (each list ended by -1)."""
    if isinstance(block, StoredRow):
        return block.tokens
    if isinstance(block, dict):
        parts = [block[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids") if k in block]
        return np.asarray([t for part in parts for t in (*part, -1)], dtype=np.int64)
    return block[0] if block.ndim == 2 else block


def digest(tokens: np.ndarray) -> str:
    """A short, stable name for a sequence's tokens (sha256 of its ids as little-endian int64)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, "<i8").tobytes()).hexdigest()[:16]


def step_blocks(plan: DataPlan, tokenizer: Any, layout: BatchLayout, step: int) -> list[tuple[int, Any]]:
    """(global block, block) for each sequence of `step` (counted from the run's first step), in training's order."""
    first, stop, count = step * layout.global_batch, (step + 1) * layout.global_batch, layout.readers
    found: dict[int, Any] = {}
    for reader in range(count):
        wanted = [g for g in range(first + (reader - first) % count, stop, count)]
        if not wanted:
            continue
        skip = wanted[0] // count  # the reader's blocks before its first one in this step
        stream = train_blocks(plan, tokenizer, Worker(index=reader, count=count), layout.window)
        state = stream.fresh_state()
        if plan.stored is not None:
            state, skip = {"emitted": skip}, 0
        blocks = stream.blocks(state)
        for _ in range(skip):
            if next(blocks, None) is None:
                raise _beyond(step, reader)
        for g in wanted:
            item = next(blocks, None)
            if item is None:
                raise _beyond(step, reader)
            found[g] = item[0]
    return sorted(found.items())


def _beyond(step: int, reader: int) -> HftrainError:
    return HftrainError(
        f"--step {step}: the training data ends before it (logical reader {reader} has no more blocks); give an "
        "earlier step."
    )


def write_step(
    out: TextIO, plan: DataPlan, tokenizer: Any, layout: BatchLayout, step: int, decode: bool = False
) -> int:
    """One JSON object per sequence of `step`, in training's order: its token ids (`input_ids`; a stored row whole,
    seq_len + 1), where it came from, its digest and, with `decode`, its text. Returns the count."""
    written = 0
    for index, (block_at, block) in enumerate(step_blocks(plan, tokenizer, layout, step)):
        record: dict[str, Any] = {"step": step, "index": index, "global_block": block_at}
        tokens = sequence_tokens(block)
        if isinstance(block, StoredRow):
            record["item"] = block.item
        if isinstance(block, dict):  # a preference pair: its id lists as TRL's collator gets them
            record.update({k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in block.items()})
        else:
            record["input_ids"] = tokens.tolist()
            if isinstance(block, np.ndarray) and block.ndim == 2:  # an instruction block: its loss mask too
                record["labels"] = block[1].tolist()
        record["sha256"] = digest(tokens)
        if decode and not isinstance(block, dict):
            record["text"] = tokenizer.decode(tokens.tolist())
        out.write(json.dumps(record) + "\n")
        written += 1
    return written


class ConsumedRecord:
    """What one process trained on, appended as it reads (data.record_batches): a line per micro-batch with each
    sequence's global block, digest and (stored order) item, in RUN/batches/rank-P.jsonl. A resumed run appends the
    steps it trains again after its checkpoint: the last line for a block is what the finished run used."""

    def __init__(self, folder: Path, rank: int, processes: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self.rank, self.processes = folder / f"rank-{rank}.jsonl", rank, processes

    def write(self, first_sample: int, blocks: list[Any]) -> None:
        """`blocks` are this rank's samples first_sample, first_sample + 1, ...: global blocks k·P + rank."""
        record: dict[str, Any] = {
            "global_blocks": [(first_sample + i) * self.processes + self.rank for i in range(len(blocks))],
            "sha256": [digest(sequence_tokens(b)) for b in blocks],
        }
        if blocks and isinstance(blocks[0], StoredRow):
            record["items"] = [b.item for b in blocks]
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def read_consumed(folder: Path) -> dict[int, dict[str, Any]]:
    """Every global block a run trained on -> its digest (and item), the last record of each block winning."""
    seen: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            items = record.get("items") or [None] * len(record["global_blocks"])
            for g, sha, item in zip(record["global_blocks"], record["sha256"], items):
                seen[g] = {"sha256": sha, "item": item}
    return seen
