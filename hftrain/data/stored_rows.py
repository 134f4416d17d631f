"""A Megatron corpus in its stored order (data.order: stored): Pythia's order, where item i of the index is the i-th
training sequence of seq_len + 1 tokens and nothing is shuffled.

The run's global block order is round-robin over its logical readers (parallel/readers.py: global block g is block
g // L of reader g % L), so reader r's j-th block is row first + r + L·j, and global block g is row first + g: step s
of a global batch B trains rows [first + B·s, first + B·(s+1)) on any launch (1 process, 2, two nodes, after an elastic
resume), and each micro-step's rows over all processes are gpt-neox's (DistributedBatchSampler over a sequential
sampler), dealt round-robin to the processes where gpt-neox gives each a contiguous slice (the same sum). `first` is
B·data.start_step: a run begins at any step without reading what lies before it.

A row trains seq_len predictions: inputs row[:-1], targets row[1:] (transformers' ``shift_labels``), as gpt-neox
trains its 2,049-token rows. A reader takes every L-th row, a chunk of them at a time: each chunk's sizes and
pointers are checked against the index, and of the .bin only its own rows' bytes are read (one concurrent request
for all of them on an object store), so memory is a chunk whatever the corpus's size and the bytes read are the
bytes trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hftrain.data.folder_stream import check_ids
from hftrain.data.megatron import MegatronCorpus
from hftrain.data.stream import Worker
from hftrain.errors import HftrainError

CHUNK_ROWS = 256  # consecutive rows a reader reads at once (1 MB at Pythia's 2,049 uint16 tokens)


@dataclass(frozen=True)
class StoredRow:
    """One training sequence of seq_len + 1 tokens, and the item of the index it is (for `hftrain data batch`)."""

    tokens: np.ndarray
    item: int


def check_rows(corpus: MegatronCorpus, seq_len: int) -> None:
    """Every item must be one sequence of seq_len + 1 tokens: the total says so at once (each read checks its own
    items' sizes too)."""
    tokens = corpus.bin_bytes // corpus.dtype.itemsize
    if tokens != corpus.items * (seq_len + 1):
        mean = tokens / corpus.items
        length = int(corpus.sizes(0, 1)[0])
        raise HftrainError(
            f"{corpus.where}: {corpus.index_path} holds {corpus.items:,} items of {mean:,.1f} tokens on average (the "
            f"first: {length:,}), not data.seq_len + 1 = {seq_len + 1:,} each: with data.order: stored each item is "
            f"one training sequence (Pythia's: 2,049 tokens). Set data.seq_len: {length - 1} if every item is "
            f"{length:,} tokens, or read its documents as blocks (data.order: shuffled)."
        )


def rows_of_step(step: int, global_batch: int, start_step: int = 0) -> range:
    """The rows (items) step `step` of a run trains, counted from the run's first step (data.start_step)."""
    first = (start_step + step) * global_batch
    return range(first, first + global_batch)


class StoredRows:
    """Reader `worker.index` of `worker.count`: rows first + index + count·j for j = 0, 1, ... below `stop`."""

    def __init__(
        self, corpus: MegatronCorpus, seq_len: int, worker: Worker, first: int, stop: int, vocab: int | None = None
    ):
        self.corpus, self.seq_len, self.worker = corpus, seq_len, worker
        self.first, self.stop, self.vocab = first, stop, vocab
        self.loop = False

    def fresh_state(self) -> dict[str, Any]:
        return {"emitted": 0}

    def blocks(self, state: dict[str, Any]) -> Iterator[tuple[StoredRow, dict[str, Any]]]:
        count, index, emitted = self.worker.count, self.worker.index, int(state["emitted"])
        per_read = max(1, CHUNK_ROWS // count)
        while True:
            base = self.first + count * emitted  # the chunk's first row; this reader's row is base + index
            mine = range(base + index, min(base + count * per_read, self.stop), count)
            if not mine:
                return
            for item, tokens in zip(mine, self.read(mine)):
                emitted += 1
                yield StoredRow(tokens, item), {"emitted": emitted}

    def read(self, rows: range) -> np.ndarray:
        """The rows (items first, first + step, ...) as a (len(rows), seq_len + 1) int64 array. The index entries of
        the whole span are checked; of the .bin only these rows' bytes are read."""
        corpus, width = self.corpus, self.seq_len + 1
        first, span = rows[0], rows[-1] + 1 - rows[0]
        sizes = corpus.sizes(first, span)
        wrong = np.nonzero(sizes != width)[0]
        if wrong.size:
            at = first + int(wrong[0])
            raise HftrainError(
                f"{corpus.where}: item {at:,} of {corpus.index_path} holds {int(sizes[wrong[0]]):,} tokens, not "
                f"data.seq_len + 1 = {width:,}: in data.order: stored every item is one training sequence; read the "
                "corpus as documents (data.order: shuffled), or give the rows' own data.seq_len."
            )
        pointers = corpus.pointers(first, span)
        row_bytes = width * corpus.dtype.itemsize
        if not np.array_equal(pointers, pointers[0] + row_bytes * np.arange(span)):
            raise HftrainError(
                f"{corpus.where}: the items {first:,}-{first + span - 1:,} of {corpus.index_path} do not lie one "
                "after another in the .bin; the index does not describe this .bin. Copy both again."
            )
        if rows.step == 1:
            spans = [(int(pointers[0]), len(rows) * row_bytes)]
        else:
            spans = [(int(pointers[0]) + (row - first) * row_bytes, row_bytes) for row in rows]
        data = b"".join(corpus.read_spans(spans))
        tokens = np.frombuffer(data, corpus.dtype).reshape(len(rows), width).astype(np.int64)
        if self.vocab is not None:
            outside = np.nonzero((tokens >= self.vocab).any(axis=1) | (tokens < 0).any(axis=1))[0]
            if outside.size:  # the first row that holds one, named by its item
                at = int(outside[0])
                check_ids(tokens[at], self.vocab, f"{corpus.where}: item {rows[at]:,} of {corpus.prefix}")
        return tokens
