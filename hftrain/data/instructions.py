"""Instruction data: prompt/completion and chat examples -> blocks with the loss on the answer only.

Each example becomes (input ids, labels) with labels -100 on the prompt / non-assistant tokens. Short examples
are packed into seq_len blocks, best fit within each shuffle window (as TRL's "bfd" packing does over a whole
dataset), with position ids restarting at 0 for each example: data/packed_batch.py turns them into the form
each attention kernel needs so that examples never attend to each other (TRL#1230). With packing off, each
example is padded to seq_len instead. Blocks are arrays of shape (3, seq_len): input ids,
labels, position ids; the windows, shuffling and resumable positions are BlockStream's.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from hftrain.data.stream import BlockStream, DocumentStream, source_epochs

IGNORE = -100
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: indices of `lengths` grouped into bins of at most `capacity`, each item
    (longest first) into the fullest bin it fits; within a bin, items keep their read order. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin), sorted
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
        else:
            space, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (space - lengths[i], b))
    return [sorted(b) for b in bins]


def encode_example(tokenizer: Any, example: dict[str, Any], eos: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one example; labels are -100 outside the completion / assistant turns."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    if "prompt" in example:
        prompt, answer = ids(example["prompt"]), ids(example["completion"]) + [eos]
        return prompt + answer, [IGNORE] * len(prompt) + answer
    messages, template = example["messages"], tokenizer.chat_template or CHATML
    render = lambda msgs, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen, chat_template=template
    )
    tokens: list[int] = []
    labels: list[int] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            header = render(messages[:i], gen=True)  # everything up to where the assistant starts writing
            piece = ids(header[len(done) :])
            tokens, labels = tokens + piece, labels + [IGNORE] * len(piece)
            done = header
        full = render(messages[: i + 1])
        piece = ids(full[len(done) :])
        tokens += piece
        labels += piece if message["role"] == "assistant" else [IGNORE] * len(piece)
        done = full
    return tokens + [eos], labels + [eos]


class ExampleStream(BlockStream):
    """BlockStream for instruction examples: packed (or padded) blocks of (ids, labels, position ids)."""

    def __init__(self, docs: DocumentStream, tokenizer: Any, seq_len: int, window: int, packing: bool):
        super().__init__(docs, tokenizer, seq_len, window)
        self.packing = packing
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.truncated = 0

    def _fill(
        self, start: dict[str, Any], pieces: Iterator[tuple[Any, bool]], live: dict[str, Any]
    ) -> tuple[list[np.ndarray], dict[str, Any]]:
        """Read a window's examples (window x seq_len tokens when packing, window examples when padding) and place
        them: best fit, longest first, into as few blocks as hold them. The window is re-read from its start on
        resume, so the same examples land in the same blocks. An example read across a source's epoch boundary
        starts the next window (`carry`)."""
        examples = [(list(ids), list(labels)) for ids, labels in start["carry"]]
        tokens, epochs, carry = sum(len(ids) for ids, _ in examples), source_epochs(live), []
        while (tokens < self.window * self.seq_len) if self.packing else (len(examples) < self.window):
            example, _ = next(pieces, (None, True))  # examples are never cut into pieces
            if example is None:
                break
            ids, labels = encode_example(self.tokenizer, example, self.eos)
            if len(ids) > self.seq_len:
                self.truncated += 1
                ids, labels = ids[: self.seq_len], labels[: self.seq_len]
            if source_epochs(live) != epochs and examples:  # a window also ends where a source starts a new epoch
                carry = [[ids, labels]]
                break
            examples.append((ids, labels))
            tokens += len(ids)
        groups = (
            best_fit([len(ids) for ids, _ in examples], self.seq_len)
            if self.packing
            else [[i] for i in range(len(examples))]
        )
        blocks = [self._block([examples[i] for i in group]) for group in groups]
        return blocks, {"docs": copy.deepcopy(live), "carry": carry}

    def _block(self, rows: list[tuple[list[int], list[int]]]) -> np.ndarray:
        block = np.empty((3, self.seq_len), dtype=np.int64)
        block[0].fill(self.pad)
        block[1].fill(IGNORE)
        block[2] = np.arange(self.seq_len)
        at = 0
        for ids, labels in rows:
            n = len(ids)
            block[0, at : at + n], block[1, at : at + n], block[2, at : at + n] = ids, labels, np.arange(n)
            at += n
        if at < self.seq_len:
            block[2, at:] = np.arange(self.seq_len - at)  # padding: its own segment, never a target
        return block
