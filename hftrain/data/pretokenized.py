"""Pre-tokenized shards: tokenize and pack once (`hftrain data prepare`), then train without a tokenizer pass.

Layout of a prepared directory (local or any fsspec URL, e.g. s3://bucket/tokenized/neox-2048/):
  manifest.json              seq_len, dtype, tokenizer fingerprint, shards with their block counts
  train-00000.bin, ...       packed blocks: raw little-endian uint16 (vocab <= 65536) or uint32, seq_len per block
  validation.bin             the validation blocks (held-out documents or the validation source)
  tokenizer/                 the tokenizer the blocks were made with
Blocks are read by offset, so a worker reads only its own shards (or blocks) and a resume seeks straight to
its position.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np

from hftrain.data.shares import share_of, span
from hftrain.data.stream import BlockStream, Worker, _mix
from hftrain.errors import HftrainError
from hftrain.network import require_backend

MANIFEST = "manifest.json"
PREPARED_NAME = re.compile(r"^(manifest\.json|validation\.bin|train-[\w-]+\.bin|tokenizer)$")  # what a prepare writes
VERSION = 1


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What makes two tokenizers give the same ids: vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps({"vocab": vocab, "eos": tokenizer.eos_token}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def block_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


class ShardWriter:
    """Appends blocks to train-NNNNN.bin files of at most shard_bytes each, then writes the manifest."""

    def __init__(self, out: str, seq_len: int, tokenizer: Any, shard_bytes: int, storage_options: dict[str, Any], prefix: str = "train"):
        self.out, self.seq_len, self.options, self.prefix = out.rstrip("/"), seq_len, storage_options, prefix
        self.dtype = block_dtype(len(tokenizer))
        self.blocks_per_shard = max(1, shard_bytes // (seq_len * self.dtype.itemsize))
        self.shards: list[dict[str, Any]] = []
        self.fingerprint, self.vocab = tokenizer_fingerprint(tokenizer), len(tokenizer)
        self._file: Any = None

    def add(self, block: np.ndarray) -> None:
        if self._file is None or self.shards[-1]["blocks"] >= self.blocks_per_shard:
            self._close()
            name = f"{self.prefix}-{len(self.shards):05d}.bin"
            self._file = fsspec.open(_join(self.out, name), "wb", **self.options).open()
            self.shards.append({"name": name, "blocks": 0})
        self._file.write(block.astype(self.dtype).tobytes())
        self.shards[-1]["blocks"] += 1

    @property
    def blocks(self) -> int:
        return sum(s["blocks"] for s in self.shards)

    def close(self) -> list[dict[str, Any]]:
        """Close the open shard; the shards written, in order."""
        self._close()
        return self.shards

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self, validation: list[np.ndarray], source: dict[str, Any], before: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """Write validation.bin and the manifest; `before`: shards other writers wrote, listed first."""
        self._close()
        self.shards = [*before, *self.shards]
        with fsspec.open(_join(self.out, "validation.bin"), "wb", **self.options) as f:
            for block in validation:
                f.write(block.astype(self.dtype).tobytes())
        blocks = sum(s["blocks"] for s in self.shards)
        manifest = {
            "version": VERSION,
            "seq_len": self.seq_len,
            "dtype": self.dtype.str,
            "tokenizer": {"fingerprint": self.fingerprint, "vocab_size": self.vocab},
            "shards": self.shards,
            "blocks": blocks,
            "tokens": blocks * self.seq_len,
            "validation": {"name": "validation.bin", "blocks": len(validation)},
            "source": source,
        }
        with fsspec.open(_join(self.out, MANIFEST), "w", **self.options) as f:
            f.write(json.dumps(manifest, indent=2))
        return manifest


def read_manifest(root: str, storage_options: dict[str, Any], where: str) -> dict[str, Any]:
    require_backend(root, f"{where}.pretokenized")
    try:
        with fsspec.open(_join(root, MANIFEST), "r", **storage_options) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise HftrainError(
            f"{where}.pretokenized: no {MANIFEST} in {root}; write one with `hftrain data prepare RECIPE --out {root}`."
        ) from None
    if manifest.get("version") != VERSION:
        raise HftrainError(f"{where}.pretokenized: {root} was prepared by another hftrain version; prepare it again.")
    return manifest


def check_compatible(manifest: dict[str, Any], root: str, seq_len: int, tokenizer: Any) -> None:
    if manifest["seq_len"] != seq_len:
        raise HftrainError(
            f"data.seq_len: {seq_len}, but the shards in {root} hold blocks of {manifest['seq_len']} tokens. "
            f"Set data.seq_len={manifest['seq_len']}, or prepare the data again with this seq_len."
        )
    if manifest["tokenizer"]["fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise HftrainError(
            f"tokenizer: not the tokenizer the shards in {root} were prepared with (fingerprint "
            f"{manifest['tokenizer']['fingerprint']}). Use tokenizer.path: {_join(root, 'tokenizer')} (copied locally "
            "if remote), or prepare the data again with this tokenizer."
        )


class PretokenizedStream(BlockStream):
    """BlockStream over prepared shards: the same windows, shuffling and positions, no tokenizer."""

    def __init__(
        self,
        root: str,
        manifest: dict[str, Any],
        storage_options: dict[str, Any],
        seed: int,
        worker: Worker,
        window: int,
        loop: bool = True,
    ):
        self.root, self.manifest, self.options = root, manifest, storage_options
        self.seed, self.worker, self.window, self.loop = seed, worker, window, loop
        self.seq_len, self.dtype = manifest["seq_len"], np.dtype(manifest["dtype"])
        self.shuffle = window > 1
        sizes = [int(shard["blocks"]) for shard in manifest["shards"]]
        self.share = share_of(sizes, True, worker.index, worker.count)  # whole shards if they deal out evenly, else a block range of each

    def fresh_state(self) -> dict[str, Any]:
        return {"start": {"epoch": 0, "shard": 0, "block": 0}, "window": 0, "emitted": 0}

    def _my_shards(self, epoch: int) -> list[int]:
        mine = list(self.share.shards)
        if self.shuffle:
            import random

            random.Random(_mix(self.seed, self.worker.index, epoch, 7)).shuffle(mine)
        return mine

    def _reader(self, start: dict[str, Any]) -> tuple[Any, Any]:
        return None, None  # blocks are read by position in _fill: no document reader

    def _fill(self, start: dict[str, Any], pieces: Any = None, live: Any = None) -> tuple[list[np.ndarray], dict[str, Any]]:
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
            shard = self.manifest["shards"][mine[cur["shard"]]]
            first, stop = span(self.share.part(mine[cur["shard"]]), int(shard["blocks"]))
            at = max(cur["block"], first)
            for index, block in self._read(shard, at, min(self.window - len(blocks), stop - at)):
                cur["block"] = index + 1
                blocks.append(block)
            if max(cur["block"], first) >= stop:
                cur = {**cur, "shard": cur["shard"] + 1, "block": 0}
        return blocks, cur

    def _read(self, shard: dict[str, Any], first: int, count: int) -> Iterator[tuple[int, np.ndarray]]:
        count = min(count, shard["blocks"] - first)
        if count <= 0:
            return
        size = self.seq_len * self.dtype.itemsize
        name = _join(self.root, shard["name"])
        try:
            with fsspec.open(name, "rb", **self.options) as f:
                f.seek(first * size)
                data = f.read(count * size)
        except FileNotFoundError:
            raise HftrainError(f"{name}: shard listed in the manifest is missing; restore it or prepare the data again.") from None
        if len(data) != count * size:
            raise HftrainError(f"{name}: shard is truncated (expected {shard['blocks']} blocks); prepare the data again.")
        arr = np.frombuffer(data, dtype=self.dtype).reshape(count, self.seq_len).astype(np.int64)
        yield from zip(range(first, first + count), arr)


def validation_from(root: str, manifest: dict[str, Any], storage_options: dict[str, Any], limit: int) -> list[np.ndarray]:
    info = manifest["validation"]
    stream = PretokenizedStream(root, {**manifest, "shards": [info]}, storage_options, 0, Worker(), window=1, loop=False)
    return [block for _, block in stream._read(info, 0, min(limit, info["blocks"]))]
