"""Token folders as block streams (token_folder.py has the layout and its checks): one folder's block ranges, with the
same windows, shuffling and resumable positions as text tokenized on the fly, and a mixture of folders by weight."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from hftrain.data.shares import share_of, span
from hftrain.data.stream import BlockStream, Worker, _mix
from hftrain.data.token_folder import Shard, TokenFolder, join
from hftrain.errors import HftrainError


class FolderStream(BlockStream):
    """BlockStream over one folder's block ranges: the same windows, shuffling and positions, no tokenizer."""

    def __init__(
        self,
        folder: TokenFolder,
        shards: list[Shard],
        seq_len: int,
        seed: int,
        worker: Worker,
        window: int,
        loop: bool = True,
        vocab: int | None = None,
    ):
        self.folder, self.shards, self.options = folder, shards, folder.options
        self.seed, self.worker, self.window, self.loop = seed, worker, window, loop
        self.seq_len, self.dtype, self.vocab = seq_len, folder.dtype, vocab
        self.shuffle = window > 1
        # whole files if they deal out evenly, else a block range of each
        self.share = share_of([s.blocks for s in shards], True, worker.index, worker.count)

    def fresh_state(self) -> dict[str, Any]:
        return {"start": {"epoch": 0, "shard": 0, "block": 0}, "window": 0, "emitted": 0}

    def _my_shards(self, epoch: int) -> list[int]:
        mine = list(self.share.shards)
        if self.shuffle:
            random.Random(_mix(self.seed, self.worker.index, epoch, 7)).shuffle(mine)
        return mine

    def _reader(self, start: dict[str, Any]) -> tuple[Any, Any]:
        return None, None  # blocks are read by position in _fill: no document reader

    def _fill(
        self, start: dict[str, Any], pieces: Any = None, live: Any = None
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        cur, blocks = dict(start), []
        empty_epochs = 0
        while len(blocks) < self.window:
            mine = self._my_shards(cur["epoch"])
            if cur["shard"] >= len(mine):
                if not self.loop or empty_epochs:
                    break
                empty_epochs = 0 if blocks else 1
                cur = {"epoch": cur["epoch"] + 1, "shard": 0, "block": 0}
                if blocks:  # a window ends with its reader's epoch: small data is shuffled an epoch at a time
                    break
                continue
            shard = self.shards[mine[cur["shard"]]]
            first, stop = span(self.share.part(mine[cur["shard"]]), shard.blocks)
            at = max(cur["block"], first)
            for index, block in self.read(shard, at, min(self.window - len(blocks), stop - at)):
                cur["block"] = index + 1
                blocks.append(block)
            if max(cur["block"], first) >= stop:
                cur = {**cur, "shard": cur["shard"] + 1, "block": 0}
        if not blocks and not self.loop:
            return blocks, cur
        if not blocks:
            raise HftrainError(
                f"{self.folder.where}: logical reader {self.worker.index} of {self.worker.count} has no block of "
                f"{self.seq_len} tokens in {self.folder.root}; lower data.readers or data.seq_len, or give more data."
            )
        return blocks, cur

    def read(self, shard: Shard, first: int, count: int) -> Iterator[tuple[int, np.ndarray]]:
        """Blocks first .. first + count - 1 of the shard (block numbers within it)."""
        count = min(count, shard.blocks - first)
        if count <= 0:
            return
        size = self.seq_len * self.dtype.itemsize
        name = join(self.folder.root, shard.name)
        data = self.folder.read_bytes(shard.name, (shard.first + first) * size, count * size)
        if len(data) != count * size:
            raise HftrainError(
                f"{name}: the file is shorter than when the run opened it; restore it or prepare the data again."
            )
        arr = np.frombuffer(data, dtype=self.dtype).reshape(count, self.seq_len).astype(np.int64)
        if self.vocab is not None:
            check_ids(arr, self.vocab, name)
        yield from zip(range(first, first + count), arr)


class FolderMixture:
    """Blocks drawn from several folders by their weights (data.train: [{pretokenized: A, weight: 3}, ...]). Draw n
    picks its folder from a generator seeded by (seed, reader, n // CHUNK), so a position is each folder's own plus
    the number of draws: a resume continues exactly, on any process count."""

    CHUNK = 4096

    def __init__(self, streams: list[FolderStream], weights: list[float], seed: int, worker: Worker):
        self.streams, self.seed, self.worker = streams, seed, worker
        total = sum(weights)
        self.p = np.asarray([w / total for w in weights])
        self._chunk: tuple[int, np.ndarray] | None = None

    def fresh_state(self) -> dict[str, Any]:
        return {"parts": [s.fresh_state() for s in self.streams], "drawn": 0}

    def _pick(self, n: int) -> int:
        chunk = n // self.CHUNK
        if self._chunk is None or self._chunk[0] != chunk:
            rng = np.random.default_rng([self.seed, self.worker.index, chunk, 0x6D6978])
            self._chunk = (chunk, rng.choice(len(self.streams), size=self.CHUNK, p=self.p))
        return int(self._chunk[1][n % self.CHUNK])

    def blocks(self, state: dict[str, Any]) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
        parts, drawn = list(state["parts"]), int(state["drawn"])
        readers = [s.blocks(p) for s, p in zip(self.streams, parts)]
        while True:
            i = self._pick(drawn)
            item = next(readers[i], None)
            if item is None:
                return
            parts[i] = item[1]
            drawn += 1
            yield item[0], {"parts": list(parts), "drawn": drawn}


def check_ids(tokens: np.ndarray, vocab: int, where: str) -> None:
    """Every id read must be one of the tokenizer's: an id outside it is data tokenized with another tokenizer."""
    if tokens.size and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab else int(tokens.min())
        raise HftrainError(
            f"{where}: token id {bad:,} is not in the recipe's tokenizer ({vocab:,} ids): the data was tokenized "
            "with another tokenizer. Use the tokenizer it was made with, or prepare the data again."
        )
