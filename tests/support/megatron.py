"""Megatron / gpt-neox indexed corpora written here with numpy from the published layout (not with hftrain's reader):
the 34-byte header, int32 sizes, int64 pointers, int64 doc_idx, and the .bin whole or cut at a byte count into
PREFIX-NNNNN-of-MMMMM.bin shards as Pythia's preshuffled Pile is."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CODES = {np.dtype("u1"): 1, np.dtype("i1"): 2, np.dtype("<i2"): 3, np.dtype("<i4"): 4, np.dtype("<i8"): 5}
CODES[np.dtype("<u2")] = 8


def write_megatron(
    prefix: Path,
    items: list[np.ndarray],
    doc_ends: list[int] | None = None,
    dtype: str = "<u2",
    shard_bytes: int | None = None,
    code: int | None = None,
    modes: bool = False,
) -> Path:
    """PREFIX.idx and PREFIX.bin (or its shards of `shard_bytes`, cut wherever that falls, numbered -of-(count - 1)
    like Pythia's 21 files -of-00020). `doc_ends`: each document's end in items (default: one item a document)."""
    dt = np.dtype(dtype)
    sizes = np.asarray([len(x) for x in items], "<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype("<i8") * dt.itemsize)]).astype("<i8")
    doc_idx = np.asarray([0, *(doc_ends or range(1, len(items) + 1))], "<i8")
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dt] if code is None else code)
    header += struct.pack("<Q", len(items)) + struct.pack("<Q", len(doc_idx))
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
        if modes:
            f.write(np.zeros(len(items), "i1").tobytes())
    data = b"".join(np.asarray(x, dt).tobytes() for x in items)
    if shard_bytes is None:
        Path(f"{prefix}.bin").write_bytes(data)
    else:
        cuts = range(0, len(data), shard_bytes)
        for i, at in enumerate(cuts):
            Path(f"{prefix}-{i:05d}-of-{len(cuts) - 1:05d}.bin").write_bytes(data[at : at + shard_bytes])
    return prefix


def rows_corpus(prefix: Path, rows: int, width: int, vocab: int, seed: int = 0, **kw) -> np.ndarray:
    """A corpus of `rows` items of `width` tokens (stored order's rows); returns the rows as written."""
    rng = np.random.default_rng(seed)
    table = rng.integers(1, vocab, size=(rows, width))
    write_megatron(prefix, list(table), **kw)
    return table


def pythia_rows(path: Path, step: int, batch: int, width: int, dtype: str = "<u2") -> np.ndarray:
    """Pythia's own arithmetic (utils/batch_viewer.py): step s is items [batch·s, batch·(s+1)) of the whole .bin,
    every item `width` tokens, read here straight from the bytes (or from the shards joined)."""
    parts = sorted(path.parent.glob(path.name + "-*-of-*.bin")) or [Path(f"{path}.bin")]
    data = b"".join(p.read_bytes() for p in parts)
    flat = np.frombuffer(data, np.dtype(dtype))
    return flat.reshape(-1, width)[batch * step : batch * (step + 1)].astype(np.int64)


def write_large_megatron(prefix: Path, items: int, item_tokens: int, vocab: int) -> Path:
    """A corpus too large to read whole (items x item_tokens uint16 tokens), written a chunk at a time: one chunk of
    random ids repeated, so that writing it costs the disk's time and no more memory than the chunk."""
    chunk_items = max(1, (32 << 20) // (2 * item_tokens))
    chunk = np.random.default_rng(0).integers(0, vocab, chunk_items * item_tokens).astype("<u2").tobytes()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.bin", "wb") as f:
        for start in range(0, items, chunk_items):
            f.write(chunk[: min(chunk_items, items - start) * item_tokens * 2])
    sizes = np.full(items, item_tokens, "<i4")
    pointers = np.arange(items, dtype="<i8") * (2 * item_tokens)
    doc_idx = np.arange(items + 1, dtype="<i8")
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    header += struct.pack("<Q", items) + struct.pack("<Q", items + 1)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    return prefix
