"""`hftrain data prepare` (tokenize and pack once into shards) and `hftrain data inspect` (look before training)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec

from ..recipe_schema import Recipe
from ..tokenizer import load_tokenizer
from .loader import first_documents, plan_data, train_documents, validation_blocks
from .pretokenized import ShardWriter
from .stream import BlockStream


def prepare(recipe: Recipe, out: str, shard_mb: float, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenize one pass over the training data into packed shards + manifest at `out` (local or URL)."""
    options = storage_options or {}
    plan = plan_data(recipe.data, recipe.training.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(recipe, Path(tmp), lambda n: first_documents(plan, n))
        tokenizer.save_pretrained(Path(tmp) / "tok")
        fs, root = fsspec.core.url_to_fs(out, **options)
        fs.makedirs(root, exist_ok=True)
        fs.put(str(Path(tmp) / "tok"), root.rstrip("/") + "/tokenizer", recursive=True)
    writer = ShardWriter(out, recipe.data.seq_len, tokenizer, int(shard_mb * 2**20), options)
    docs = train_documents(plan, loop=False)
    docs.shuffle = False  # shards keep the source order; training shuffles by window
    stream = BlockStream(docs, tokenizer, recipe.data.seq_len, window=1024)
    start = time.perf_counter()
    for block, _ in stream.blocks(stream.fresh_state()):
        writer.add(block)
    validation = [b["input_ids"].numpy() for b in validation_blocks(plan, tokenizer)]
    manifest = writer.finish(validation, recipe.data.model_dump(mode="json"))
    seconds = time.perf_counter() - start
    print(
        f"prepared {out}: {len(manifest['shards'])} shard(s), {manifest['blocks']:,} blocks of {manifest['seq_len']} = "
        f"{manifest['tokens']:,} tokens ({manifest['tokens'] / max(seconds, 1e-9):,.0f} tokens/s), "
        f"{manifest['validation']['blocks']} validation blocks, dtype {manifest['dtype']}.\n"
        f"train from it with:  data.train: {{pretokenized: {out}}}   tokenizer: {{path: {out.rstrip('/')}/tokenizer}}"
    )
    return manifest


def inspect(recipe: Recipe, blocks: int = 2, sample_docs: int = 200) -> str:
    """Sources, shard counts, the first blocks decoded, and an estimate of the token count."""
    plan = plan_data(recipe.data, recipe.training.seed)
    lines = []
    if plan.manifest is not None:
        m = plan.manifest
        lines.append(f"pre-tokenized: {plan.pretokenized.pretokenized}: {len(m['shards'])} shard(s), {m['blocks']:,} blocks x {m['seq_len']} = {m['tokens']:,} tokens")
        return "\n".join(lines)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(recipe, Path(tmp), lambda n: first_documents(plan, n))
    total_bytes = 0
    for source in plan.train:
        where = source.source.path or source.source.dataset or source.source.builtin
        size = _size(source.shards, source.source.storage_options) if source.source.path else None
        total_bytes += size or 0
        lines.append(f"{source.where}: {where}  {len(source.shards)} shard(s)" + (f", {size / 1e6:,.1f} MB" if size else "") +
                     f", weight {source.source.weight:g}")  # fmt: skip
        lines += [f"    {name}" for name in source.shards[:3]] + (["    ..."] if len(source.shards) > 3 else [])
    sample = list(first_documents(plan, sample_docs))
    sample_bytes = sum(len(d.encode()) for d in sample)
    sample_tokens = sum(len(ids) + 1 for ids in tokenizer(sample, add_special_tokens=False)["input_ids"])
    if sample_bytes:
        lines.append(f"tokens per byte in the first {len(sample)} documents: {sample_tokens / sample_bytes:.3f}")
        if total_bytes:
            lines.append(f"estimated tokens: ~{total_bytes * sample_tokens / sample_bytes:,.0f} (file bytes x tokens/byte; compressed files count more)")
    docs = train_documents(plan, loop=False)
    stream = BlockStream(docs, tokenizer, recipe.data.seq_len, window=recipe.data.shuffle_window)
    for i, (block, _) in enumerate(stream.blocks(stream.fresh_state())):
        if i >= blocks:
            break
        lines.append(f"--- block {i} ({len(block)} tokens) ---\n{tokenizer.decode(block)}")
    return "\n".join(lines)


def _size(shards: list[str], options: dict[str, Any]) -> int | None:
    try:
        fs, _ = fsspec.core.url_to_fs(shards[0], **options)
        return sum(fs.size(s) or 0 for s in shards[:1000]) * max(1, len(shards) // 1000 or 1)
    except (OSError, ValueError):
        return None
