"""JSONL files: records by line, resumable at a byte offset, readable in byte ranges.

A plain file is entered at any byte: a reader seeks to its range and starts at the next line, and a record's
identity is the offset where its line starts, the same whichever reader reads it. A compressed file is read
from its start, and a record's identity is its line number. Line numbers for messages are counted only when a
message is shown.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import fsspec

from hftrain.data.shares import ShardSlice, span
from hftrain.data.text_pieces import Record, record_pieces

if TYPE_CHECKING:
    from hftrain.data.sources import BadRecords

PROBE_BYTES = 1 << 20  # how far into a byte range ranges_hold_lines looks for a line start


def ranges_hold_lines(url: str, storage_options: dict[str, Any], size: int | None, count: int) -> bool:
    """Whether each of `count` equal byte ranges of a plain JSONL file of `size` bytes holds the start of a line
    within its first PROBE_BYTES: only then can its readers take a range each. A record longer than a range
    (a book, a 64 MB blob) would leave a reader with nothing; such a file's readers each read it whole and keep
    every count-th record instead. The answer depends only on the file, so every reader reaches the same one.
    Exact range reads (no read-ahead)."""
    if not size or size < count:
        return False
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    for r in range(1, count):
        start, stop = ShardSlice(r, count).span(size)
        # a line starts in [start, stop) iff a newline ends one in [start-1, stop-1)
        at, end = (start - 1, min(stop - 1, start - 1 + PROBE_BYTES))
        while at < end:
            chunk = fs.cat_file(path, start=at, end=min(end, at + (1 << 16)))
            if not chunk:
                return False
            if b"\n" in chunk:
                break
            at += len(chunk)
        else:
            return False
    return True


def read_jsonl(
    f: Any,
    shard: str,
    codec: str | None,
    take: Any,
    pos: tuple[int, ...],
    bad: BadRecords,
    part: ShardSlice | None = None,
    size: int | None = None,
) -> Iterator[Record]:
    """Plain files seek to the byte offset, and a record's identity is the offset where its line starts (the
    same whichever reader reads it); compressed ones decompress and skip the lines already read, and a record's
    identity is its line number. pos[2], when given, is how many characters of the next record's text were read.
    `part`: only the lines that start in this reader's byte range of the file."""
    skip = pos[2] if len(pos) > 2 else 0
    stop = None
    with f:
        if codec is None:
            start, stop = span(part, size or 0) if part is not None else (0, None)
            offset, lineno = (pos[0] if tuple(pos) != (0, 0) else _line_start(f, start)), 0
            f.seek(offset)
            lines = iter(f)
        else:
            offset = lineno = pos[1]
            lines = _lines(f)
            for _ in range(lineno):
                next(lines, None)
        for raw in lines:
            if stop is not None and offset >= stop:
                return
            first = offset if codec is None else lineno
            lineno += 1
            offset += len(raw) if codec is None else 0
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as err:
                bad(
                    _line_name(f, shard, codec, first, bad),
                    f"not valid JSON ({getattr(err, 'msg', err)})",
                    "Fix or remove that line",
                )
                continue
            value, problem = take(obj)
            if problem:
                bad(
                    _line_name(f, shard, codec, first, bad),
                    problem,
                    "Fix that line or set the field names on this source",
                )
                continue
            if isinstance(value, str) and not value.strip():
                continue  # an empty or whitespace-only text is no document
            if codec is None:
                yield from record_pieces(value, (first, 0), (offset, 0), skip, key=first)
            else:
                yield from record_pieces(value, (first, first), (lineno, lineno), skip)
            skip = 0


def _line_start(f: Any, at: int) -> int:
    """The offset of the first line that starts at or after byte `at` (reads up to the next newline, in chunks)."""
    if at <= 0:
        return 0
    f.seek(at - 1)
    offset = at - 1
    while chunk := f.read(1 << 16):
        newline = chunk.find(b"\n")
        if newline >= 0:
            return offset + newline + 1
        offset += len(chunk)
    return offset


def _line_name(f: Any, shard: str, codec: str | None, first: int, bad: BadRecords) -> str:
    """ "file:line" for a message about the record at `first` (a line number when compressed, else the byte offset
    where its line starts: its line number is counted only when the message is shown)."""
    if codec is not None:
        return f"{shard}:{first + 1}"
    if not bad.fails:
        return shard
    here = f.tell()
    f.seek(0)
    newlines, left = 0, first
    while left > 0 and (chunk := f.read(min(left, 1 << 20))):
        newlines += chunk.count(b"\n")
        left -= len(chunk)
    f.seek(here)
    return f"{shard}:{newlines + 1}"


def _lines(f: Any) -> Iterator[bytes]:
    """Lines of a binary stream; decompressing file objects do not all support iteration."""
    parts: list[bytes] = []  # of a line longer than one read (joined once: no quadratic copying)
    while chunk := f.read(1 << 20):
        *complete, rest = chunk.split(b"\n")
        for line in complete:
            yield b"".join(parts) + line + b"\n"
            parts = []
        parts.append(rest)
    if tail := b"".join(parts):
        yield tail
