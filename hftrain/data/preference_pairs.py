"""Preference pairs for DPO: records (prompt, chosen, rejected) -> token ids, streamed like every other source.

A pair is tokenized exactly as TRL's DPOTrainer tokenizes its dataset (an implicit prompt is extracted from two
conversations, EOS ends a plain-text answer, the answer starts where the tokenized prompt and prompt + answer
part), so that TRL's own collator and loss see what they would see in a plain TRL run
(tests/data/test_preference.py compares the ids with TRL's on the shipped pairs). A pair whose prompt alone fills
data.seq_len is dropped, as TRL drops it (no answer token would be left); the collator truncates the rest.
Pairs are read in shuffle windows with resumable positions (BlockStream) and are never packed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hftrain.data.instructions import CHATML
from hftrain.data.stream import BlockStream, DocumentStream, source_epochs
from hftrain.errors import HftrainError


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_pair(tokenizer: Any, record: dict[str, Any]) -> dict[str, list[int]]:
    """prompt_ids, chosen_ids and rejected_ids of one pair, as TRL's DPOTrainer tokenizes it."""
    from trl import extract_prompt, is_conversational

    if "prompt" not in record:
        record = extract_prompt(record)
    if is_conversational(record):

        def ids(messages: list[dict[str, str]], generation: bool = False) -> list[int]:
            return tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation
            )["input_ids"]

        prompt = ids(record["prompt"], generation=True)
        chosen, rejected = ids(record["prompt"] + record["chosen"]), ids(record["prompt"] + record["rejected"])
    else:
        eos = tokenizer.eos_token
        ends = lambda text: text if text.endswith(eos) else text + eos  # noqa: E731
        prompt = tokenizer(text=record["prompt"])["input_ids"]
        chosen = tokenizer(text=record["prompt"] + ends(record["chosen"]))["input_ids"]
        rejected = tokenizer(text=record["prompt"] + ends(record["rejected"]))["input_ids"]
    n = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return {"prompt_ids": prompt[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]}


def needs_chat_template(tokenizer: Any, record: dict[str, Any]) -> bool:
    """Conversations need a chat template; a tokenizer without one gets ChatML (saved with the model)."""
    return tokenizer.chat_template is None and isinstance(record.get("chosen"), list)


def use_chatml(tokenizer: Any) -> None:
    tokenizer.chat_template = CHATML


SAME_ANSWERS_SAMPLE = 200  # the first training pairs read at the start to count those whose two answers are one


def same_answers(first: list[dict[str, Any]], tokenizer: Any, where: str) -> str | None:
    """A pair whose chosen answer is its rejected one teaches DPO nothing (the two log-probabilities cancel, its loss
    stays at log 2 and its gradient at 0). Among the `first` records (as tokenized for training): none, None; some,
    the line that says how many; most, refused naming `where` (the data.train source)."""
    if first and needs_chat_template(tokenizer, first[0]):
        # as training will tokenize them (the run's own tokenizer is not touched here)
        tokenizer = copy.deepcopy(tokenizer)
        use_chatml(tokenizer)
    pairs = [encode_pair(tokenizer, record) for record in first]
    same = sum(pair["chosen_ids"] == pair["rejected_ids"] for pair in pairs)
    if not same:
        return None
    what = (
        f"{where}: {same} of the first {len(pairs)} preference pairs have the same chosen and rejected answer, from "
        "which DPO learns nothing"
    )
    if 2 * same > len(pairs):
        raise HftrainError(f"{what}; most pairs are like that: check the records' chosen and rejected fields.")
    return what


def pair_tokens(pair: dict[str, Any]) -> int:
    """Token positions the policy reads for one pair: the prompt twice, each answer once."""
    return 2 * len(pair["prompt_ids"]) + len(pair["chosen_ids"]) + len(pair["rejected_ids"])


class PreferenceStream(BlockStream):
    """BlockStream for preference pairs: each item is one tokenized pair (a dict of id lists)."""

    def __init__(self, docs: DocumentStream, tokenizer: Any, seq_len: int, window: int):
        super().__init__(docs, tokenizer, seq_len, window)
        self.dropped = 0  # prompts that fill seq_len alone (TRL drops them too)

    def _fill(
        self, start: dict[str, Any], pieces: Iterator[tuple[Any, bool]], live: dict[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """Read a window of pairs; a pair read across a source's epoch boundary starts the next window."""
        pairs, epochs, carry = [copy.deepcopy(p) for p in start["carry"]], source_epochs(live), []
        while len(pairs) < self.window:
            record, _ = next(pieces, (None, True))
            if record is None:
                break
            pair = encode_pair(self.tokenizer, record)
            if len(pair["prompt_ids"]) >= self.seq_len:
                self.dropped += 1
                continue
            if source_epochs(live) != epochs and pairs:
                carry = [pair]
                break
            pairs.append(pair)
        return pairs, {"docs": copy.deepcopy(live), "carry": carry}


def records(docs: DocumentStream, limit: int) -> list[dict[str, Any]]:
    """The first `limit` pair records of a stream, as read (for the held-out set and TRL's dataset checks)."""
    out = []
    for record in docs.documents(docs.fresh_state()):
        out.append(record)
        if len(out) >= limit:
            break
    return out
