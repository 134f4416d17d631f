"""Megatron / gpt-neox indexed token files (``PREFIX.idx`` with ``PREFIX.bin``, or the ``.bin`` cut into shards), read
where they lie, local or any fsspec URL, by byte range.

The layout (gpt-neox megatron/data/indexed_dataset.py, megatron-core datasets/indexed_dataset.py, Pythia's
utils/mmap_dataset.py), little-endian:

  .idx   magic b"MMIDIDX\\x00\\x00", version u64 = 1, dtype code u8, items u64, documents u64  (34 bytes), then
         int32 sizes[items] (tokens per item), int64 pointers[items] (byte offset of each item in the .bin),
         int64 doc_idx[documents] (documents as item ranges); megatron-core may append int8 modes[items].
  .bin   the items' tokens one after another, no header. Pythia's preshuffled Pile is one .bin cut at a fixed byte
         count into PREFIX-00000-of-00020.bin ... PREFIX-00020-of-00020.bin (21 files; cuts fall inside items):
         they are read here as the one .bin they were cut from, each shard's size checked against the index.

The dtype codes of gpt-neox and megatron-core agree on every integer type and differ only on the two float codes
(6 and 7, swapped), which hold no token ids: both are refused. Nothing is read whole: the header and each read's
slice of the index come by range, so memory is the same for a 1 MB corpus and for the 600 GB Pile.

Two ways to read a corpus (data.order): ``stored`` (Pythia's order; stored_rows.py) takes item i as the i-th training
sequence of seq_len + 1 tokens; ``shuffled`` reads the tokens as a token folder's (folder_stream.py: blocks, windows,
mixtures by weight, held-out blocks), for corpora that NeMo / Megatron-LM preprocessing wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from hftrain.data.token_folder import TokenFile, TokenFolder
from hftrain.errors import HftrainError
from hftrain.network import require_backend, storage_options_with_timeouts

MAGIC = b"MMIDIDX\x00\x00"
HEADER = 34
TOKEN_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}  # gpt-neox and megatron-core agree here
FLOAT_CODES = (6, 7)  # float32 / float64 (in opposite order in the two tables): no token ids
SHARD = re.compile(r"-(?P<index>\d+)-of-(?P<of>\d+)\.bin$")


@dataclass(frozen=True)
class BinFile:
    """One file of the .bin: the whole .bin, or one shard of it starting at byte `start` of the whole."""

    path: str
    start: int
    size: int


@dataclass(frozen=True)
class MegatronCorpus(TokenFolder):
    """A checked Megatron corpus: its index's counts, the files of its .bin, and (as a TokenFolder with one file) its
    tokens for reading as blocks."""

    prefix: str = ""
    index_path: str = ""
    bin_files: tuple[BinFile, ...] = ()
    items: int = 0
    documents: int = 0
    dtype_code: int = 8
    pointers_at: int = HEADER  # byte offset of the pointers array in the .idx
    _fs: Any = field(default=None, compare=False, repr=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(TOKEN_DTYPES[self.dtype_code])

    @property
    def bin_bytes(self) -> int:
        return sum(p.size for p in self.bin_files)

    def fs(self) -> Any:
        return self._fs if self._fs is not None else fsspec.core.url_to_fs(self.prefix, **self.options)[0]

    def read_bytes(self, name: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of the whole .bin, from the shards that hold them."""
        return self.read_spans([(start, length)])[0]

    def read_spans(self, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (start, length) of the whole .bin, from the shards that hold them, in one fsspec
        cat_ranges: on an object store its ranges are fetched at once, so a reader that takes every L-th row reads
        its rows' bytes only, at one request's latency."""
        paths, starts, ends, owners = [], [], [], []
        for k, (start, length) in enumerate(spans):
            for part in self.bin_files:
                lo, hi = max(start, part.start), min(start + length, part.start + part.size)
                if lo < hi:
                    paths.append(part.path), starts.append(lo - part.start), ends.append(hi - part.start)
                    owners.append(k)
        pieces: list[list[bytes]] = [[] for _ in spans]
        for k, data in zip(owners, _cat_ranges(self.fs(), paths, starts, ends, self.where)):
            pieces[k].append(data)
        return [b"".join(p) for p in pieces]

    def sizes(self, first: int, count: int) -> np.ndarray:
        """Tokens of items [first, first + count), from the index."""
        at = HEADER + 4 * first
        return np.frombuffer(_cat(self.fs(), self.index_path, at, at + 4 * count, self.where), "<i4")

    def pointers(self, first: int, count: int) -> np.ndarray:
        """Byte offsets in the .bin of items [first, first + count), from the index."""
        at = self.pointers_at + 8 * first
        return np.frombuffer(_cat(self.fs(), self.index_path, at, at + 8 * count, self.where), "<i8")

    def describe(self) -> str:
        files = f"{len(self.bin_files)} shards" if len(self.bin_files) > 1 else "one .bin"
        return (
            f"{self.where}: {self.prefix}: Megatron indexed corpus, {self.items:,} items in {self.documents:,} "
            f"document entries, {self.bin_bytes // self.dtype.itemsize:,} {self.dtype.name} tokens in {files}"
        )


def _cat(fs: Any, path: str, start: int, end: int, where: str) -> bytes:
    return _cat_ranges(fs, [path], [start], [end], where)[0]


def _cat_ranges(fs: Any, paths: list[str], starts: list[int], ends: list[int], where: str) -> list[bytes]:
    """Bytes [start, end) of each path, each checked to be whole: a file that went or shrank says so."""
    try:
        if len(paths) == 1:
            found = [fs.cat_file(paths[0], start=starts[0], end=ends[0])]
        else:
            found = fs.cat_ranges(paths, starts, ends, on_error="raise")
    except FileNotFoundError as e:
        path = e.filename or (e.args[0] if e.args and str(e.args[0]) in paths else paths[0])
        raise HftrainError(f"{where}: {path} is missing (it was there when the run opened the corpus).") from None
    for path, start, end, data in zip(paths, starts, ends, found):
        if len(data) != end - start:
            raise HftrainError(
                f"{where}: {path} is shorter than when the run opened it (bytes {start:,}-{end:,} asked, "
                f"{len(data):,} read); restore the file."
            )
    return found


def split_prefix(given: str) -> str:
    """PREFIX from PREFIX, PREFIX.idx, PREFIX.bin or one of PREFIX's shards (PREFIX-00003-of-00020.bin)."""
    shard = SHARD.search(given)
    if shard:
        return given[: shard.start()]
    for ext in (".idx", ".bin"):
        if given.endswith(ext):
            return given[: -len(ext)]
    return given


def open_megatron(given: str, options: dict[str, Any], where: str) -> MegatronCorpus:
    """The corpus at `given` (a prefix or one of its files), checked: the index's header and length, the .bin or its
    complete set of shards, and their sizes against the index. Reads the header and two index entries."""
    require_backend(given, where)
    prefix = split_prefix(given)
    options = dict(options)
    fs, _ = fsspec.core.url_to_fs(prefix, **storage_options_with_timeouts(prefix, options))
    index_path = prefix + ".idx"
    try:
        head = fs.cat_file(index_path, start=0, end=HEADER)
        index_size = int(fs.info(index_path)["size"])
    except FileNotFoundError:
        raise HftrainError(
            f"{where}: no index {index_path}; give the prefix of a Megatron corpus (PREFIX.idx beside PREFIX.bin or "
            "its shards PREFIX-NNNNN-of-MMMMM.bin), as gpt-neox's or Megatron's preprocess_data.py writes it."
        ) from None
    code, items, documents = _header(head, index_path, where)
    arrays = HEADER + 12 * items + 8 * documents
    if index_size not in (arrays, arrays + items):  # megatron-core may append one mode byte per item
        raise HftrainError(
            f"{where}: {index_path} is {index_size:,} bytes, but its header's {items:,} items and {documents:,} "
            f"documents take {arrays:,}: the index is truncated or not a Megatron index; copy it again."
        )
    if items == 0:
        raise HftrainError(f"{where}: {index_path} indexes no item: the corpus is empty.")
    itemsize = np.dtype(TOKEN_DTYPES[code]).itemsize
    pointers_at = HEADER + 4 * items
    last_size = int(np.frombuffer(fs.cat_file(index_path, start=pointers_at - 4, end=pointers_at), "<i4")[0])
    last_at = pointers_at + 8 * (items - 1)
    last_ptr = int(np.frombuffer(fs.cat_file(index_path, start=last_at, end=last_at + 8), "<i8")[0])
    expected = last_ptr + last_size * itemsize
    parts = _bin_files(fs, prefix, where)
    total = sum(p.size for p in parts)
    if total != expected:
        files = parts[0].path if len(parts) == 1 else f"its {len(parts)} shards ({parts[0].path} ...)"
        cut = "short: a download or copy did not finish" if total < expected else "longer than the index says"
        raise HftrainError(
            f"{where}: {files} hold {total:,} bytes, but {index_path} ends its last item at byte {expected:,} "
            f"({cut}); the .bin and the .idx must come from the same preprocessing run. Copy the files again."
        )
    tokens = total // itemsize
    return MegatronCorpus(
        root=prefix,
        where=where,
        options=options,
        token_size=itemsize,
        files=(TokenFile(prefix.rstrip("/").rsplit("/", 1)[-1], tokens),),
        tokenizer_name="",
        prefix=prefix,
        index_path=index_path,
        bin_files=tuple(parts),
        items=items,
        documents=documents,
        dtype_code=code,
        pointers_at=pointers_at,
        _fs=fs,
    )


def _header(head: bytes, index_path: str, where: str) -> tuple[int, int, int]:
    """(dtype code, items, documents) from the 34-byte header, or the line that says what is wrong."""
    if len(head) < HEADER or head[:9] != MAGIC:
        legacy = " (the older TNTIDX format, which hftrain does not read)" if head[:6] == b"TNTIDX" else ""
        raise HftrainError(
            f"{where}: {index_path} is not a Megatron MMIDIDX index{legacy}: it starts with {head[:9]!r}, not "
            f"{MAGIC!r}. Give the .idx that gpt-neox's or Megatron's preprocess_data.py wrote."
        )
    version = int(np.frombuffer(head[9:17], "<u8")[0])
    if version != 1:
        raise HftrainError(f"{where}: {index_path} is index version {version}; hftrain reads version 1.")
    code = head[17]
    if code in FLOAT_CODES or code not in TOKEN_DTYPES:
        what = "floating-point numbers, not token ids" if code in FLOAT_CODES else "an unknown dtype code"
        raise HftrainError(
            f"{where}: {index_path} says its tokens are dtype code {code}: {what} (token codes: "
            f"{', '.join(f'{k} {np.dtype(v).name}' for k, v in sorted(TOKEN_DTYPES.items()))})."
        )
    items, documents = (int(x) for x in np.frombuffer(head[18:34], "<u8"))
    return code, items, documents


def _bin_files(fs: Any, prefix: str, where: str) -> list[BinFile]:
    """PREFIX.bin whole, else its shards PREFIX-NNNNN-of-MMMMM.bin in order (all of them, numbered from 0)."""
    if fs.exists(prefix + ".bin"):
        return [BinFile(prefix + ".bin", 0, int(fs.info(prefix + ".bin")["size"]))]
    protocol = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    found = {}
    for path, info in fs.glob(prefix + "-*-of-*.bin", detail=True).items():
        m = SHARD.search(path)
        if m and path[: m.start()].rsplit("/", 1)[-1] == prefix.rsplit("/", 1)[-1]:
            name = path if "://" in path or not protocol else protocol + path
            found[int(m["index"])] = (name, int(info["size"]), int(m["of"]))
    if not found:
        raise HftrainError(
            f"{where}: no {prefix}.bin and no shards {prefix}-NNNNN-of-MMMMM.bin beside {prefix}.idx; copy the .bin "
            "(or all its shards) there."
        )
    of = sorted({v[2] for v in found.values()})
    count, missing = len(found), [i for i in range(max(found) + 1) if i not in found]
    if len(of) > 1 or missing or count not in (of[0], of[0] + 1):
        said = (
            f"numbered -of-{', -of-'.join(f'{n:05d}' for n in of)}"
            if len(of) > 1
            else f"missing {', '.join(f'{i:05d}' for i in missing[:5])}"
            if missing
            else f"{count} found, numbered 00000 to {max(found):05d} of {of[0]:05d}"
        )
        raise HftrainError(
            f"{where}: the shards of {prefix} are incomplete ({said}); copy every shard of the .bin beside its .idx."
        )
    parts, start = [], 0
    for i in sorted(found):
        name, size, _ = found[i]
        parts.append(BinFile(name, start, size))
        start += size
    return parts
