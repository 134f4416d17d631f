"""Text read in bounded pieces: memory depends on PIECE_BYTES, never on the size of a file or a document.

A *piece* is a run of one document's text; ``end`` says the document ends with it (EOS follows). A plain
text file is one document unless the source says documents are separated by blank lines or by lines. A
piece's position is where reading continues: a byte offset into the (decompressed) file, always at a
character boundary, so a stream restarts inside a document exactly. A JSONL/parquet record's text longer
than PIECE_CHARS is cut the same way; its position inside the record is a character count.

Before a text file is read from its start, its first SNIFF_BYTES are checked: a binary file, UTF-16 text
or a file of nothing but whitespace is a bad shard (an error naming it, or skipped with on_bad_record=skip).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

PIECE_BYTES = 1 << 14  # bytes read per step from a text file
PIECE_CHARS = 1 << 14  # a record's text is cut into pieces of at most this many characters
SNIFF_BYTES = 1 << 16  # checked for binary / UTF-16 / whitespace-only before a text file is read
MAX_HELD_BYTES = 4 * PIECE_BYTES  # trailing whitespace held back to find a boundary, at most
BAD_SHARE = 0.01  # share of NUL bytes or undecodable bytes in the sniffed prefix that makes a file "not text"
SEPARATORS: dict[str, re.Pattern[bytes] | None] = {
    "file": None,
    "line": re.compile(rb"\r?\n"),
    "blank_line": re.compile(rb"\r?\n(?:[ \t\r]*\n)+"),
}
_WS = b" \t\r\n"


@dataclass
class Record:
    """A document, or a piece of one, and the stream position just after it: (resume offset, documents
    completed so far[, characters into the current record]). Documents completed is also the 1-based line of
    a JSONL record; the third number is only there inside a record cut into pieces."""

    text: Any  # a str; a dict for instruction formats (prompt/completion or messages)
    pos: tuple[int, ...]
    end: bool = True
    key: int | None = None  # the record's identity in its shard when it is not its number (plain JSONL: its offset)

    @property
    def index(self) -> int:
        """The document's identity in its shard, the same for every piece of it and for every reader: its number
        (0-based) unless `key` says otherwise."""
        if self.key is not None:
            return self.key
        return self.pos[1] - 1 if self.end else self.pos[1]


def sniff_problem(head: bytes, whole: bool) -> str | None:
    """Why a file whose first bytes are `head` is not UTF-8 text (None when it is). `whole`: head is the file."""
    if not head:
        return None
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head.count(0) > BAD_SHARE * len(head):
        return "is not UTF-8 text (NUL bytes in its first 64 KiB: a binary file, or UTF-16/32 text)"
    sample = head[: _char_boundary(head, len(head))] if not whole else head
    undecodable = sample.decode("utf-8", errors="replace").count("\ufffd") - sample.decode(
        "utf-8", errors="ignore"
    ).count("\ufffd")
    if undecodable > BAD_SHARE * len(sample):
        return (
            f"is not UTF-8 text ({undecodable} undecodable bytes in its "
            f"first {len(sample):,}: a binary file, or another encoding)"
        )
    if whole and not head.strip():
        return "holds only whitespace (no text to train on)"
    return None


def text_pieces(
    f: Any, seekable: bool, pos: tuple[int, ...], boundary: str, bad: Callable[[str], None]
) -> Iterator[Record]:
    """Pieces of a plain text file from byte offset pos[0]; pos[1] documents completed before it, and pos[2]
    bytes of the current document already read when the position is inside one.

    `bad(problem)` is called once when a file read from its start is not text; reading then stops."""
    offset, docs = pos[0], pos[1]
    doc_bytes = pos[2] if len(pos) > 2 else 0  # > 0: the position is inside a document
    if offset:
        if seekable:
            f.seek(offset)
        else:
            _skip(f, offset)
    sep = SEPARATORS[boundary]
    buf, base = b"", offset
    while True:
        first = base == 0 and not buf
        size = SNIFF_BYTES if first else PIECE_BYTES
        chunk = _read_full(f, size)
        eof = len(chunk) < size
        if first and (problem := sniff_problem(chunk, whole=eof)):
            bad(problem)
            return
        buf += chunk
        cut = _region_end(buf, sep, eof)
        region, buf = buf[:cut], buf[cut:]
        for text, end, after in _split(region, sep, base, eof):
            if end:
                if doc_bytes or text.strip():  # a document of nothing but whitespace is no document
                    yield Record(text.decode("utf-8", errors="replace"), (after, docs + 1))
                docs, doc_bytes = docs + 1, 0
            else:
                doc_bytes += len(text)
                yield Record(text.decode("utf-8", errors="replace"), (after, docs, doc_bytes), end=False)
        base += cut
        if eof:
            return


def _read_full(f: Any, n: int) -> bytes:
    """n bytes, fewer only at the end (decompressing readers may return less than asked before the end)."""
    data = f.read(n)
    while 0 < len(data) < n:
        more = f.read(n - len(data))
        if not more:
            break
        data += more
    return data


def _region_end(buf: bytes, sep: re.Pattern[bytes] | None, eof: bool) -> int:
    """How much of `buf` can be split now. A separator may continue past the buffer, so with separators
    the region stops before the whitespace ahead of the last newline; a line longer than MAX_HELD_BYTES (or
    a file that is one document) is cut at a character boundary, before trailing whitespace."""
    if eof:
        return len(buf)
    if sep is not None:
        nl = buf.rfind(b"\n")
        if nl >= 0:
            i = nl
            while i > 0 and buf[i - 1] in _WS:
                i -= 1
            if i > 0:
                return i
        if len(buf) <= MAX_HELD_BYTES:
            return 0  # keep reading: one long line, or a run of whitespace
    cut = _char_boundary(buf, len(buf))
    j = cut
    while j > 0 and buf[j - 1] in _WS:
        j -= 1
    return j if j > 0 and sep is not None else cut


def _split(region: bytes, sep: re.Pattern[bytes] | None, base: int, eof: bool) -> Iterator[tuple[bytes, bool, int]]:
    """(text, document ends here, offset after) for the documents and the open remainder of one region."""
    start = 0
    if sep is not None:
        for m in sep.finditer(region):
            yield region[start : m.start()], True, base + m.end()
            start = m.end()
    if start < len(region) or eof:
        yield region[start:], eof, base + len(region)


def _char_boundary(buf: bytes, end: int) -> int:
    """The largest cut <= end that does not split a UTF-8 character."""
    i = end
    while i > max(0, end - 3) and (buf[i - 1] & 0xC0) == 0x80:
        i -= 1
    if i == 0:
        return end
    lead = buf[i - 1]
    if lead < 0xC0:  # ASCII, or a stray continuation byte: nothing to hold back
        return end
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return i - 1 if end - (i - 1) < need else end


def _skip(f: Any, n: int) -> None:
    while n > 0:
        got = f.read(min(n, 1 << 20))
        if not got:
            return
        n -= len(got)


def record_pieces(
    text: Any, before: tuple[int, int], after: tuple[int, int], skip: int = 0, key: int | None = None
) -> Iterator[Record]:
    """One record's text as pieces of at most PIECE_CHARS (a dict, or a short text, is one Record).

    `before`: the position at the record's start; `after`: just after it; `skip`: characters already read;
    `key`: the record's identity (Record.key)."""
    if not isinstance(text, str) or len(text) - skip <= PIECE_CHARS:
        yield Record(text[skip:] if skip else text, after, key=key)
        return
    for start in range(skip, len(text), PIECE_CHARS):
        stop = start + PIECE_CHARS
        if stop >= len(text):
            yield Record(text[start:], after, key=key)
        else:
            yield Record(text[start:stop], (before[0], before[1], stop), end=False, key=key)
