"""The torch side of the data pipeline: a packed IterableDataset, a DataLoader that remembers its position,
and the validation blocks.

Each DataLoader worker of each rank is one logical worker of the BlockStream. Workers hand their position to
the main process with every sample; the loader keeps the latest per worker, and that is what a checkpoint
saves. A DataLoader takes batches from its workers in turn, so after n batches the next one comes from worker
n % W: a resumed loader rotates the worker numbering to keep that order, and the batches after a resume are
exactly the ones the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import HftrainError
from ..recipe_schema import DataSection, Source
from .instructions import ExampleStream
from .pretokenized import PretokenizedStream, read_manifest, validation_from
from .sources import BadRecords
from .stream import BlockStream, DocumentStream, SourcePlan, Worker, plan_sources

POSITION_KEY = "_hftrain_position"


@dataclass
class DataPlan:
    """Everything a worker needs to build its stream (picklable: sent to DataLoader worker processes)."""

    section: DataSection
    train: list[SourcePlan]
    validation: list[SourcePlan] | None
    seed: int
    manifest: dict[str, Any] | None = None  # when training from `hftrain data prepare` shards

    @property
    def pretokenized(self) -> Source | None:
        return self.section.train[0] if self.manifest is not None else None

    @property
    def manifest_tokens(self) -> int | None:
        """Training tokens in the prepared shards (None for text streamed and tokenized on the fly)."""
        return int(self.manifest["tokens"]) if self.manifest is not None else None


def plan_data(section: DataSection, seed: int) -> DataPlan:
    """List every source's shards once (and fail early, naming the source, if one is empty or missing)."""
    validation = plan_sources([section.validation], "data.validation") if section.validation else None
    first = section.train[0]
    if first.pretokenized:
        manifest = read_manifest(first.pretokenized, first.storage_options, "data.train[0]")
        return DataPlan(section, [], validation, seed, manifest)
    return DataPlan(section, plan_sources(section.train, "data.train"), validation, seed)


def train_blocks(plan: DataPlan, tokenizer: Any, worker: Worker) -> BlockStream:
    """The block stream of one logical worker: prepared shards, or documents tokenized on the fly."""
    section = plan.section
    source = plan.pretokenized
    if source is not None:
        assert plan.manifest is not None and source.pretokenized is not None
        return PretokenizedStream(source.pretokenized, plan.manifest, source.storage_options, plan.seed, worker, section.shuffle_window)
    return text_or_examples(train_documents(plan, worker), tokenizer, section, section.shuffle_window)


def is_instruction_data(section: DataSection) -> bool:
    return section.train[0].format in ("prompt_completion", "chat")


def text_or_examples(docs: DocumentStream, tokenizer: Any, section: DataSection, window: int) -> BlockStream:
    """Packed text blocks, or instruction examples with their loss masks."""
    if is_instruction_data(section):
        return ExampleStream(docs, tokenizer, section.seq_len, window, section.packing)
    return BlockStream(docs, tokenizer, section.seq_len, window)


def train_documents(plan: DataPlan, worker: Worker = Worker(), loop: bool = True) -> DocumentStream:
    section = plan.section
    return DocumentStream(
        plans=plan.train,
        seed=plan.seed,
        worker=worker,
        holdout_every=0 if plan.validation else section.holdout_every,
        split="train",
        shuffle=section.shuffle_window > 1,
        loop=loop,
        bad=BadRecords(section.on_bad_record),
    )


def first_documents(plan: DataPlan, n: int) -> Iterator[str]:
    """The first n training documents in a fixed order (for learning a tokenizer)."""
    if plan.pretokenized is not None:
        raise HftrainError(
            "tokenizer.train: the training data is pre-tokenized, so there is no text to learn from; use the tokenizer "
            f"the shards were made with: tokenizer.path: {plan.pretokenized.pretokenized}/tokenizer (copied locally if remote)."
        )
    stream = train_documents(plan, loop=False)
    stream.shuffle = False
    for i, text in enumerate(stream.documents(stream.fresh_state())):
        if i >= n:
            return
        yield text


class PackedDataset(IterableDataset):
    """Blocks of seq_len token ids for one rank; each DataLoader worker reads its own part."""

    def __init__(self, plan: DataPlan, tokenizer: Any, rank: int, world_size: int, resume: dict[str, Any] | None):
        self.plan, self.tokenizer, self.rank, self.world_size = plan, tokenizer, rank, world_size
        self.resume = resume or {}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers = info.num_workers if info else 1
        local = ((info.id if info else 0) + self.resume.get("rotation", 0)) % workers
        worker = Worker(index=self.rank * workers + local, count=self.world_size * workers)
        stream = train_blocks(self.plan, self.tokenizer, worker)
        state = self.resume.get("workers", {}).get(str(worker.index)) or stream.fresh_state()
        for block, position in stream.blocks(state):
            yield {**as_sample(block), POSITION_KEY: (worker.index, position)}


def as_sample(block: Any) -> dict[str, torch.Tensor]:
    """A text block (labels = inputs) or an instruction block (3 rows: ids, labels, position ids)."""
    block = torch.from_numpy(block.astype("int64"))
    if block.dim() == 2:
        return {"input_ids": block[0], "labels": block[1], "position_ids": block[2]}
    return {"input_ids": block, "labels": block.clone()}


def collate_blocks(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch: dict[str, Any] = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels", "position_ids") if k in samples[0]}
    if POSITION_KEY in samples[0]:
        batch[POSITION_KEY] = [s[POSITION_KEY] for s in samples]
    return batch


class ResumableLoader:
    """Wraps a DataLoader over PackedDataset; strips positions from batches and keeps the latest per worker."""

    def __init__(self, dataset: PackedDataset, batch_size: int, num_workers: int, prefetch_factor: int | None = None):
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.prefetch_factor = prefetch_factor
        resume = dataset.resume
        self.batches = int(resume.get("batches", 0))
        self.positions: dict[str, Any] = dict(resume.get("workers", {}))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_blocks,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            persistent_workers=False,
        )
        for batch in loader:
            for worker, position in batch.pop(POSITION_KEY):
                self.positions[str(worker)] = position
            self.batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        workers = max(self.num_workers, 1)
        return {
            "version": 1,
            "batches": self.batches,
            "rotation": self.batches % workers,
            "num_workers": workers,
            "world_size": self.dataset.world_size,
            "seq_len": self.dataset.plan.section.seq_len,
            "workers": self.positions,
        }


def check_resumable(saved: dict[str, Any], num_workers: int, world_size: int, where: str) -> None:
    """A data position is only meaningful for the same worker layout."""
    now = (max(num_workers, 1), world_size)
    then = (saved.get("num_workers"), saved.get("world_size"))
    if now != then:
        raise HftrainError(
            f"{where}: the data position was saved with {then[0]} dataloader worker(s) x {then[1]} process(es), "
            f"this run has {now[0]} x {now[1]}. Resume with the same training.dataloader_num_workers and process "
            "count, or start a new training.output_dir."
        )


def validation_blocks(plan: DataPlan, tokenizer: Any) -> list[dict[str, Any]]:
    """The fixed validation set: the first eval_blocks blocks of the validation source or the held-out documents."""
    section = plan.section
    source = plan.pretokenized
    if source is not None and plan.validation is None:
        assert plan.manifest is not None and source.pretokenized is not None
        blocks = validation_from(source.pretokenized, plan.manifest, source.storage_options, section.eval_blocks)
        return [{"input_ids": torch.from_numpy(b), "labels": torch.from_numpy(b).clone()} for b in blocks]
    docs = DocumentStream(
        plans=plan.validation or plan.train,
        seed=plan.seed,
        holdout_every=0 if plan.validation else section.holdout_every,
        split="all" if plan.validation else "holdout",
        shuffle=False,
        loop=False,
        bad=BadRecords(section.on_bad_record),
    )
    stream = text_or_examples(docs, tokenizer, section, window=section.eval_blocks)
    out = []
    for block, _ in stream.blocks(stream.fresh_state()):
        out.append(as_sample(block))
        if len(out) >= section.eval_blocks:
            break
    if not out:
        what = "data.validation" if plan.validation else "the held-out training documents (data.holdout_every)"
        fix = "give more validation text or lower data.seq_len" if plan.validation else (
            "give data.validation, or more documents (a .txt file is one document unless the source's document_boundary "
            "is blank_line or line), or lower data.holdout_every or data.seq_len")
        raise HftrainError(f"{what}: less text than one block of data.seq_len={section.seq_len} tokens; {fix}.")
    return out
