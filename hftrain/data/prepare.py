"""`hftrain data prepare` (tokenize and pack once into shards) and `hftrain data inspect` (look before training)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from hftrain import network
from hftrain.checkpoint.output_lock import LOCK_FILE, owning
from hftrain.data.chunking import TokenRun
from hftrain.data.loader import DataPlan, first_documents, plan_data, text_or_examples, train_documents, validation_blocks
from hftrain.data.prepare_pool import PrepareJob, run_units
from hftrain.data.pretokenized import MANIFEST, PREPARED_NAME, ShardWriter
from hftrain.data.sources import COMPRESSION
from hftrain.data.stream import SourcePlan, Worker
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import load_tokenizer
from hftrain.parallel.readers import DEFAULT_READERS, default_readers, default_window
from hftrain.recipe.parts import DataPrepPart, TokenizerPart


def prepare(
    part: DataPrepPart, out: str, shard_mb: float, storage_options: dict[str, Any] | None = None, processes: int | None = None
) -> dict[str, Any]:
    """Tokenize one pass over the training data into packed shards + manifest at `out` (local or URL), on
    `processes` processes (default: every core), one input shard per task (prepare_pool.py). The output is the
    same whatever the process count."""
    options = storage_options or {}
    network.require_backend(out, "--out")
    fs, root = fsspec.core.url_to_fs(out, **options)
    interrupted = fs.exists(f"{root.rstrip('/')}/{LOCK_FILE}")  # left by a prepare that was killed
    _claim_out(fs, root, out, interrupted, clean=False)  # before the lock: a refused prepare writes nothing
    with owning(out, "--out", options):
        _claim_out(fs, root, out, interrupted)
        return _prepare(part, out, shard_mb, options, processes)


def _claim_out(fs: Any, root: str, out: str, interrupted: bool, clean: bool = True) -> None:
    """--out is new, empty, or what a killed prepare left there (its files are removed); anything else stays as it
    is: a directory that already holds prepared data, or files prepare did not write."""
    if not fs.isdir(root):
        if fs.exists(root):
            raise HftrainError(f"--out {out}: is a file; give a new or empty directory for the shards.")
        return
    names = sorted(Path(p.rstrip("/")).name for p in fs.ls(root, detail=False))
    names = [n for n in names if n != LOCK_FILE]
    if MANIFEST in names:
        raise HftrainError(
            f"--out {out}: already holds prepared data ({MANIFEST}); nothing was changed. Prepare into a "
            f"new directory, or delete {out} first to prepare it again."
        )
    foreign = [n for n in names if not PREPARED_NAME.match(n)]
    if foreign or (names and not interrupted):
        raise HftrainError(
            f"--out {out}: is not empty ({', '.join((foreign or names)[:3])}{', ...' if len(foreign or names) > 3 else ''}) "
            "and was not written by `hftrain data prepare`; nothing was changed. Give a new or empty directory."
        )
    if not clean:
        return
    for name in names:
        fs.rm(f"{root.rstrip('/')}/{name}", recursive=True)
    if names:
        print(f"hftrain: removed {len(names)} file(s) an interrupted prepare left in {out}", flush=True)


def _prepare(part: DataPrepPart, out: str, shard_mb: float, options: dict[str, Any], processes: int | None) -> dict[str, Any]:
    processes = processes or os.cpu_count() or 1
    plan = plan_data(part.data, part.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(part.tokenizing, Path(tmp), lambda n: first_documents(plan, n))
        tokenizer.save_pretrained(Path(tmp) / "tok")
        fs, root = fsspec.core.url_to_fs(out, **options)
        fs.makedirs(f"{root.rstrip('/')}/tokenizer", exist_ok=True)
        for file in sorted((Path(tmp) / "tok").iterdir()):  # file by file: put(dir) would nest into an existing tokenizer/
            fs.put_file(str(file), f"{root.rstrip('/')}/tokenizer/{file.name}")
    seq_len, shard_bytes = part.data.seq_len, int(shard_mb * 2**20)
    units = [(s, k) for s, source in enumerate(plan.train) for k in range(len(source.shards))]
    job = PrepareJob(plan, tokenizer, out, shard_bytes, options)
    progress = Progress(plan.train)
    tails = ShardWriter(out, seq_len, tokenizer, shard_bytes, options, prefix="train-tails")
    carry, shards = TokenRun([], np.int32 if len(tokenizer) < 2**31 else np.int64), []
    for result in run_units(job, units, processes, progress.report):
        shards += result.shards
        carry.add(result.tail.tolist(), None)
        for block in carry.take_blocks(seq_len):
            tails.add(block)
        progress.done(result.unit, sum(s["blocks"] for s in result.shards) * seq_len)
    if not shards and not tails.blocks:
        raise HftrainError(
            f"data.train: less text than one block of data.seq_len={seq_len} tokens to prepare; give more data or lower data.seq_len."
        )
    validation = [b["input_ids"].numpy() for b in validation_blocks(plan, tokenizer)]
    manifest = tails.finish(validation, part.data.model_dump(mode="json"), before=shards)
    seconds = progress.elapsed()
    print(
        f"prepared {out}: {len(manifest['shards'])} shard(s), {manifest['blocks']:,} blocks of {manifest['seq_len']} = "
        f"{manifest['tokens']:,} tokens ({manifest['tokens'] / max(seconds, 1e-9):,.0f} tokens/s on {min(processes, len(units))} process(es)), "
        f"{manifest['validation']['blocks']} validation blocks, dtype {manifest['dtype']}.\n"
        f"train from it with:  data.train: {{pretokenized: {out}}}   tokenizer: {{path: {out.rstrip('/')}/tokenizer}}"
    )
    return manifest


class Progress:
    """A line on stderr every few seconds: tokens so far, tokens/s, and (for files) the share read and an ETA."""

    EVERY_S = 5.0

    def __init__(self, sources: list[SourcePlan]):
        self.sources = sources
        self.start = self.last = time.perf_counter()
        self.sizes = [_shard_sizes(s) for s in sources]
        self.total = sum(sum(s) for s in self.sizes if s) if all(self.sizes) else None
        self.read: dict[tuple[int, int], int] = {}  # bytes read per (source, shard)
        self.tokens: dict[tuple[int, int], int] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, unit: tuple[int, int], read: int, tokens: int) -> None:
        """A unit's progress so far (plain files: bytes read; compressed: counted when done)."""
        source, shard = unit
        if not self.sources[source].shards[shard].endswith(tuple(COMPRESSION)):
            self.read[unit] = read
        self.tokens[unit] = tokens
        self._show()

    def done(self, unit: tuple[int, int], tokens: int) -> None:
        sizes = self.sizes[unit[0]]
        self.read[unit] = sizes[unit[1]] if sizes else 0
        self.tokens[unit] = tokens
        self._show()

    def _show(self) -> None:
        now = time.perf_counter()
        if now - self.last < self.EVERY_S:
            return
        self.last = now
        tokens = sum(self.tokens.values())
        line = f"prepare: {tokens / 1e6:,.1f}M tokens, {tokens / max(now - self.start, 1e-9):,.0f} tokens/s"
        if self.total:
            done = min(sum(self.read.values()) / self.total, 1.0)
            if done > 0:
                eta = (now - self.start) * (1 - done) / done
                line += f", {100 * done:.0f}% of the data read, ETA {int(eta // 60)}m{int(eta % 60):02d}s"
        print(line, file=sys.stderr, flush=True)


def _shard_sizes(source: SourcePlan) -> list[int] | None:
    """Each shard's size in bytes, from the listing (None for datasets and the builtin corpus)."""
    return source.sizes if source.source.path is not None and source.sizes else None


def scratch_tokenizer(tokenizing: TokenizerPart, plan: DataPlan) -> Any:
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


def inspect(part: DataPrepPart, blocks: int = 2, sample_docs: int = 200) -> str:
    """Sources, shard counts, the first blocks decoded, and an estimate of the token count."""
    plan = plan_data(part.data, part.seed)
    lines = []
    if plan.manifest is not None:
        m = plan.manifest
        lines.append(
            f"pre-tokenized: {plan.pretokenized.pretokenized}: {len(m['shards'])} shard(s), {m['blocks']:,} blocks x {m['seq_len']} = {m['tokens']:,} tokens"
        )
        return "\n".join(lines)
    tokenizer = scratch_tokenizer(part.tokenizing, plan)
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
                f"estimated tokens: ~{total_bytes * sample_tokens / sample_bytes:,.0f} (file bytes x tokens/byte; compressed files count more)"
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
