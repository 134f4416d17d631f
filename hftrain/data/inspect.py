"""`hftrain data inspect`: a recipe's sources and shares, a token estimate and its first blocks decoded, before
training."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hftrain.data.loader import DataPlan, first_documents, plan_data, text_or_examples, train_documents
from hftrain.data.megatron import MegatronCorpus
from hftrain.data.part import DataPart
from hftrain.data.stream import SourcePlan, Worker
from hftrain.model.part import ModelPart
from hftrain.model.tokenizer import load_tokenizer
from hftrain.parallel.readers import DEFAULT_READERS, default_readers, default_window


def _shard_sizes(source: SourcePlan) -> list[int] | None:
    """Each shard's size in bytes, from the listing (None for datasets and the builtin corpus)."""
    return source.sizes if source.source.path is not None and source.sizes else None


def scratch_tokenizer(tokenizing: ModelPart, plan: DataPlan) -> Any:
    """The recipe's tokenizer, to look at its data: one it would train is trained here and nothing is kept."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(tokenizing, Path(tmp), lambda n: first_documents(plan, n))
    return tokenizer


def as_text(document: Any) -> str:
    """A document's text; an instruction example's prompt and answer (or its messages) joined."""
    if isinstance(document, str):
        return document
    if "prompt" in document:
        return f"{document['prompt']}{document['completion']}"
    return "\n".join(str(m.get("content", "")) for m in document["messages"])


def inspect(part: DataPart, blocks: int = 2, sample_docs: int = 200) -> str:
    """Sources, shard counts, the first blocks decoded, and an estimate of the token count."""
    plan = plan_data(part.data, part.seed)
    lines = []
    if plan.folders:
        seq_len = part.data.seq_len
        for i, folder in enumerate(plan.folders):
            if isinstance(folder, MegatronCorpus):
                stored = f"; stored order: {plan.stored_rows:,} items to train on" if plan.stored else ""
                lines.append(folder.describe() + stored)
                continue
            lines.append(
                f"{folder.where}: {folder.root}: {len(folder.files)} file(s) of {folder.token_size}-byte tokens, "
                f"{folder.tokens:,} tokens = {folder.blocks(seq_len):,} blocks of data.seq_len={seq_len} (training "
                f"reads {sum(s.blocks for s in plan.folder_shards(i)):,}), "
                f"tokenizer {folder.tokenizer_name or '(not named)'}"
                + (", with validation/" if folder.validation else "")
            )
        return "\n".join(lines)
    tokenizer = scratch_tokenizer(part.model, plan)
    total_bytes = 0
    for source in plan.train:
        where = source.source.path or source.source.dataset or source.source.builtin
        size = sum(_shard_sizes(source) or []) or None
        total_bytes += size or 0
        lines.append(
            f"{source.where}: {where}  {len(source.shards)} shard(s)"
            + (f", {size / 1e6:,.1f} MB" if size else "")
            + f", weight {source.source.weight:g}"
        )
        lines += [f"    {name}" for name in source.shards[:3]] + (["    ..."] if len(source.shards) > 3 else [])
        readers = part.data.readers or default_readers(plan.reader_limit, 1, 1)
        lines.append(f"    {source.share(Worker(0, readers)).describe()}")
    sample = [as_text(d) for d in first_documents(plan, sample_docs)]
    sample_bytes = sum(len(d.encode()) for d in sample)
    sample_tokens = sum(len(ids) + 1 for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
    if sample_bytes:
        lines.append(f"tokens per byte in the first {len(sample)} documents: {sample_tokens / sample_bytes:.3f}")
        if total_bytes:
            lines.append(
                f"estimated tokens: ~{total_bytes * sample_tokens / sample_bytes:,.0f} (file bytes x tokens/byte; "
                "compressed files count more)"
            )
    docs = train_documents(plan, loop=False)
    window = part.data.shuffle_window or default_window(DEFAULT_READERS, part.data.seq_len)  # as a run with 8 readers
    stream = text_or_examples(docs, tokenizer, part.data, window=window)  # the blocks training reads
    for i, (block, _) in enumerate(stream.blocks(stream.fresh_state())):
        if i >= blocks:
            break
        ids = block[0] if block.ndim == 2 else block  # instruction blocks: (ids, labels, position ids)
        lines.append(f"--- block {i} ({ids.shape[-1]} tokens) ---\n{tokenizer.decode(ids)}")
    return "\n".join(lines)
