"""Where a long document may be cut so that tokenizing its parts gives exactly the tokens of the whole.

BPE (and WordPiece, Unigram) tokenizers first split text into pre-tokens (GPT-2's regex: words with their
leading space, numbers, punctuation runs, whitespace) and never merge across them. So a cut at the start of
a pre-token changes nothing, provided it is a pre-token of the *whole* text: the last pre-token of a piece
may continue in the next one, so the cut goes before it, and the text after the cut waits for the next
piece. Only the last CUT_WINDOW characters are pre-tokenized to find it (the regex resynchronizes within a
pre-token or two). A "word" longer than MAX_PENDING characters (no pre-token boundary at all) is cut
anyway: the only case where the tokens can differ from whole-document tokenization.

Tokenizers without a pre-tokenizer of their own (or with a normalizer, whose offsets are not the text's)
are cut where a word ends and whitespace begins, a pre-token boundary for every whitespace-splitting
tokenizer.

The same cuts make the batches a stream tokenizes (``next_batch``: bounded in characters, so memory never depends
on a document's size), and ``TokenRun`` holds the tokens until they fill sequence-long blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

_TOKENIZE_BATCH = 32
MIN_BATCH_CHARS, MAX_BATCH_CHARS = 4096, 1 << 18  # characters tokenized per call: bounds memory and the carry
CUT_WINDOW = 1024
MAX_PENDING = 1 << 18
_WORD_THEN_SPACE = re.compile(r"(?<=\S)(?=\s)")


class SafeCut:
    """`cut(text)` -> the largest index at which `text` may be cut now (0: wait for more text)."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        usable = backend is not None and backend.normalizer is None and backend.pre_tokenizer is not None
        self.pre_tokenizer = backend.pre_tokenizer if usable else None

    def cut(self, text: str) -> int:
        origin = max(0, len(text) - CUT_WINDOW)
        window = text[origin:]
        if self.pre_tokenizer is not None:
            starts = [start for _, (start, _) in self.pre_tokenizer.pre_tokenize_str(window)]
            # starts[0] may be the tail of a pre-token that began before the window: never cut there
            candidates = [s for s in (starts[1:] if origin else starts) if s > 0 and not window[s - 1].isspace()]
            cut = origin + candidates[-1] if candidates else 0
        else:
            ends = [m.start() for m in _WORD_THEN_SPACE.finditer(window)]
            cut = origin + ends[-1] if ends and (origin or ends[-1]) else 0
        if cut == 0 and len(text) > MAX_PENDING:
            return len(text) - CUT_WINDOW
        return cut


def next_batch(
    pieces: Iterator[tuple[str, bool]], pending: str, cutter: SafeCut, budget: int = MAX_BATCH_CHARS
) -> tuple[list[str], list[bool], str]:
    """Up to _TOKENIZE_BATCH texts, about `budget` characters, each a document or a safely cut part of one (so
    that tokenizing each gives the tokens of the whole). The text after the last safe cut of an unfinished
    document is returned as the new `pending`, to be put before the next piece."""
    texts: list[str] = []
    ends: list[bool] = []
    chars = 0
    while len(texts) < _TOKENIZE_BATCH and chars < budget:
        item = next(pieces, None)
        if item is None:
            break
        text, end = item
        text = pending + text
        cut = len(text) if end else cutter.cut(text)
        pending = text[cut:]
        if cut or end:
            texts.append(text[:cut])
            ends.append(end)
            chars += cut
    return texts, ends, pending


def text_batches(pieces: Iterator[tuple[str, bool]], cutter: SafeCut) -> Iterator[tuple[list[str], list[bool]]]:
    """next_batch() until the documents end (one pass, no saved position: `hftrain data prepare`)."""
    pending = ""
    while True:
        texts, ends, pending = next_batch(pieces, pending, cutter)
        if not texts:
            return
        yield texts, ends


class TokenRun:
    """Token ids waiting to be cut into blocks: a list of arrays, joined only when blocks are taken."""

    def __init__(self, carry: list[int], dtype: Any):
        self.dtype = dtype
        self.parts = [np.asarray(carry, dtype=dtype)]
        self.count = len(carry)

    def __len__(self) -> int:
        return self.count

    def add(self, ids: list[int], eos: int | None) -> None:
        self.parts.append(np.asarray(ids if eos is None else [*ids, eos], dtype=self.dtype))
        self.count += len(ids) + (eos is not None)

    def take_blocks(self, seq_len: int) -> list[np.ndarray]:
        if self.count < seq_len:
            return []
        flat = np.concatenate(self.parts)
        n = len(flat) // seq_len
        self.parts, self.count = [flat[n * seq_len :]], len(flat) - n * seq_len
        return list(flat[: n * seq_len].reshape(n, seq_len))

    def put_back(self, ids: np.ndarray) -> None:
        self.parts.insert(0, ids)
        self.count += len(ids)

    def rest(self) -> np.ndarray:
        return np.concatenate(self.parts)
