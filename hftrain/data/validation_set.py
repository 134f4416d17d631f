"""The validation set: the blocks (or preference pairs) every evaluation scores, read once and kept in memory: the
first data.eval_blocks of data.validation, else of the training documents held out (every holdout_every-th), a
token folder's validation/ or its last blocks, or a stored-order corpus's last rows (which training never reads)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hftrain.data.folder_stream import FolderStream
from hftrain.data.loader import DataPlan, as_sample, text_or_examples
from hftrain.data.preference_pairs import records
from hftrain.data.sources import BadRecords
from hftrain.data.stored_rows import StoredRows
from hftrain.data.stream import DocumentStream, Worker
from hftrain.data.token_folder import split_validation
from hftrain.errors import HftrainError


def held_out_documents(plan: DataPlan) -> DocumentStream:
    """The validation source, or the training documents held out for validation (every holdout_every-th)."""
    return DocumentStream(
        plans=plan.validation or plan.train,
        seed=plan.seed,
        holdout_every=0 if plan.validation else plan.section.holdout_every,
        split="all" if plan.validation else "holdout",
        shuffle=False,
        loop=False,
        bad=BadRecords(plan.section.on_bad_record),
    )


def validation_pairs(plan: DataPlan) -> list[dict[str, Any]]:
    """The held-out preference pairs, as records (TRL tokenizes its evaluation set itself): eval_blocks of them."""
    pairs = records(held_out_documents(plan), plan.section.eval_blocks)
    if not pairs:
        what = "data.validation" if plan.validation else "the held-out training pairs (data.holdout_every)"
        raise HftrainError(f"{what}: no preference pair to evaluate on; give data.validation or more pairs.")
    return pairs


def validation_blocks(plan: DataPlan, tokenizer: Any) -> list[dict[str, Any]]:
    """The fixed validation set: the first eval_blocks blocks of the validation source or the held-out documents."""
    section = plan.section
    if plan.stored is not None:
        return stored_validation(plan, tokenizer)
    if plan.validation_corpus is not None:
        return corpus_blocks(plan)
    if plan.folders and plan.validation is None:
        first = plan.folders[0]
        if first.validation is not None:
            folder, shards = first.validation, first.validation.shards(section.seq_len)
        else:
            folder, shards = first, split_validation(first, section.seq_len, section.eval_blocks)[1]
        stream = FolderStream(folder, shards, section.seq_len, 0, Worker(), window=1, loop=False)
        blocks = [b for shard in shards for _, b in stream.read(shard, 0, shard.blocks)][: section.eval_blocks]
        if not blocks:
            raise HftrainError(
                f"{first.where}: no block of data.seq_len={section.seq_len} tokens to validate on in {folder.root}; "
                "give data.validation, or lower data.seq_len."
            )
        return [{"input_ids": torch.from_numpy(b), "labels": torch.from_numpy(b).clone()} for b in blocks]
    stream = text_or_examples(held_out_documents(plan), tokenizer, section, window=section.eval_blocks)
    out = []
    for block, _ in stream.blocks(stream.fresh_state()):
        out.append(as_sample(block))
        if len(out) >= section.eval_blocks:
            break
    if not out:
        what = "data.validation" if plan.validation else "the held-out training documents (data.holdout_every)"
        fix = (
            "give more validation text or lower data.seq_len"
            if plan.validation
            else (
                "give data.validation, or more documents (a .txt file is one document unless the source's "
                "document_boundary is blank_line or line), or lower data.holdout_every or data.seq_len"
            )
        )
        raise HftrainError(f"{what}: less text than one block of data.seq_len={section.seq_len} tokens; {fix}.")
    return out


def stored_validation(plan: DataPlan, tokenizer: Any) -> list[dict[str, Any]]:
    """A stored-order run's validation set: blocks of data.validation (text, or a Megatron corpus's documents), else
    the training corpus's last data.eval_blocks rows (which training never reads)."""
    section, vocab = plan.section, len(tokenizer) if tokenizer is not None else None
    if plan.validation is not None:
        stream = text_or_examples(held_out_documents(plan), tokenizer, section, window=section.eval_blocks)
        return [
            as_sample(block) for block, _ in itertools.islice(stream.blocks(stream.fresh_state()), section.eval_blocks)
        ]
    if plan.validation_corpus is not None:
        return corpus_blocks(plan)
    corpus = plan.stored
    assert corpus is not None
    first = plan.stored_rows
    rows = StoredRows(corpus, section.seq_len, Worker(), first, min(corpus.items, first + section.eval_blocks), vocab)
    out = [as_sample(row) for row, _ in rows.blocks(rows.fresh_state())]
    if not out:
        raise HftrainError(f"{corpus.where}: no item to validate on in {corpus.prefix}; give data.validation.")
    return out


def corpus_blocks(plan: DataPlan) -> list[dict[str, Any]]:
    """The first data.eval_blocks blocks of seq_len tokens of data.validation's Megatron corpus (its documents, in
    either data.order: a validation set need not be cut into training rows)."""
    corpus, seq_len = plan.validation_corpus, plan.section.seq_len
    assert corpus is not None
    shards = corpus.shards(seq_len)
    stream = FolderStream(corpus, shards, seq_len, 0, Worker(), window=1, loop=False)
    blocks, wanted = [], plan.section.eval_blocks
    for shard in shards:  # one for a corpus read as a token folder; the first eval_blocks over them all
        blocks += [b for _, b in stream.read(shard, 0, min(shard.blocks, wanted - len(blocks)))]
        if len(blocks) >= wanted:
            break
    if not blocks:
        raise HftrainError(f"{corpus.where}: less than one block of data.seq_len={seq_len} tokens in {corpus.prefix}.")
    return [{"input_ids": torch.from_numpy(b), "labels": torch.from_numpy(b).clone()} for b in blocks]
