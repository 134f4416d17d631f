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
"""

from __future__ import annotations

import re
from typing import Any

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
