"""The torch side of the data pipeline: a packed IterableDataset, a DataLoader that remembers its position,
and the validation blocks.

The run's logical readers (readers.py) are spread over this launch's ranks and DataLoader workers. Workers
hand each sample to the main process with its reader and that reader's position after it; the loader keeps
the latest per reader, and that is what a checkpoint saves. Samples come one at a time (worker k % W gives
sample k) and are batched in the main process, so the order never depends on the worker count or the
micro-batch, and a resumed loader rotates the worker numbering to continue it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hftrain.data.folder_stream import FolderMixture, FolderStream
from hftrain.data.instructions import ExampleStream
from hftrain.data.megatron import MegatronCorpus, open_megatron
from hftrain.data.packed_batch import KERNEL_FORMS, ROWS, PackedCollator, real_tokens
from hftrain.data.preference_pairs import PreferenceStream, pair_tokens, records
from hftrain.data.sources import BadRecords
from hftrain.data.stored_rows import StoredRow, StoredRows, check_rows
from hftrain.data.stream import BlockStream, DocumentStream, SourcePlan, Worker, plan_sources
from hftrain.data.token_folder import Shard, TokenFolder, open_folder, split_validation
from hftrain.errors import HftrainError
from hftrain.parallel.readers import ReaderLayout, rank_state
from hftrain.recipe.data_section import DataSection


@dataclass
class DataPlan:
    """Everything a worker needs to build its stream (picklable: sent to DataLoader worker processes)."""

    section: DataSection
    train: list[SourcePlan]
    validation: list[SourcePlan] | None
    seed: int
    folders: tuple[TokenFolder, ...] = ()  # token folders or Megatron corpora (data.train: {pretokenized | megatron})
    validation_corpus: MegatronCorpus | None = None  # data.validation: {megatron: PREFIX}
    first_row: int = 0  # data.order: stored: the first item trained, B·data.start_step (starting_at)

    @property
    def stored(self) -> MegatronCorpus | None:
        """The corpus read in its stored order (data.order: stored), else None."""
        return self.folders[0] if self.section.order == "stored" else None  # type: ignore[return-value]

    @property
    def stored_rows(self) -> int:
        """Items training may read in stored order: all, but for the last data.eval_blocks when they are the
        validation set (no data.validation)."""
        corpus = self.stored
        assert corpus is not None
        return corpus.items - (0 if self.validation or self.validation_corpus else self.section.eval_blocks)

    def starting_at(self, global_batch: int) -> DataPlan:
        """The plan of a run of `global_batch` sequences a step: a stored-order run begins at data.start_step."""
        if self.stored is None:
            return self
        return replace(self, first_row=(self.section.start_step or 0) * global_batch)

    def check_reach(self, max_steps: int, global_batch: int) -> None:
        """A stored-order run must end inside its corpus: refused before anything loads when it would not."""
        if self.stored is None:
            return
        end, rows, start = self.first_row + max_steps * global_batch, self.stored_rows, self.section.start_step or 0
        if end > rows:
            held = "" if rows == self.stored.items else f" (the last {self.section.eval_blocks} are the validation set)"
            raise HftrainError(
                f"data.train: {max_steps:,} steps of {global_batch:,} sequences from data.start_step {start:,} need "
                f"items up to {end:,}, and {self.stored.prefix} has {rows:,} to train on{held}; lower "
                f"training.max_steps to {max(0, (rows - self.first_row) // global_batch):,} or data.start_step."
            )

    @property
    def pretokenized(self) -> bool:
        return bool(self.folders)

    def folder_shards(self, i: int) -> list[Shard]:
        """Folder i's training block ranges: all its blocks, but for the first folder's last data.eval_blocks when
        they are the validation set (no validation/ of its own and no data.validation)."""
        folder, seq_len = self.folders[i], self.section.seq_len
        if i == 0 and folder.validation is None and self.validation is None:
            return split_validation(folder, seq_len, self.section.eval_blocks)[0]
        return folder.shards(seq_len)

    @property
    def folder_tokens(self) -> int | None:
        """Training tokens in the token folders (None for text streamed and tokenized on the fly)."""
        if not self.folders:
            return None
        if self.stored is not None:
            return self.stored_rows * self.section.seq_len
        return sum(s.blocks for i in range(len(self.folders)) for s in self.folder_shards(i)) * self.section.seq_len

    @property
    def reader_limit(self) -> int | None:
        """The most readers the default gives (one per shard of the source with the fewest; token folders one
        per block). Not more for a splittable source: a byte range inside one huge record holds no record, and a
        reader with no data stops the run (tests/test_scale.py: a JSONL file with a 64 MB record)."""
        if self.stored is not None:
            return None
        if self.folders:
            return max(1, min(sum(s.blocks for s in self.folder_shards(i)) for i in range(len(self.folders))))
        limits = [len(p.shards) for p in self.train]
        return min(limits) if limits else None

    def folder_note(self) -> str:
        """Where the tokenizer of the token folders is, for messages."""
        first = self.folders[0]
        return (
            f"tokenizer.path: {first.tokenizer_dir} (copied locally if remote)"
            if first.tokenizer_dir
            else "the tokenizer it was made with"
        )


def plan_data(section: DataSection, seed: int) -> DataPlan:
    """List every source's shards once (and fail early, naming the source, if one is empty or missing); token
    folders are checked whole (token_folder.open_folder)."""
    held = section.validation
    corpus = (
        open_megatron(held.megatron, held.storage_options, "data.validation.megatron")
        if held and held.megatron
        else None
    )
    validation = plan_sources([held], "data.validation") if held and corpus is None else None
    where = "data.train" if len(section.train) == 1 else "data.train[{}]"
    if section.train[0].pretokenized:
        folders = tuple(
            open_folder(s.pretokenized or "", s.storage_options, f"{where.format(i)}.pretokenized")
            for i, s in enumerate(section.train)
        )
        return DataPlan(section, [], validation, seed, folders)
    if section.train[0].megatron:
        corpora = tuple(
            open_megatron(s.megatron or "", s.storage_options, f"{where.format(i)}.megatron")
            for i, s in enumerate(section.train)
        )
        if section.order == "stored":
            check_rows(corpora[0], section.seq_len)
        return DataPlan(section, [], validation, seed, corpora, corpus)
    return DataPlan(section, plan_sources(section.train, "data.train"), validation, seed)


def train_blocks(plan: DataPlan, tokenizer: Any, worker: Worker, window: int) -> Any:
    """The block stream of one logical worker (reader), shuffled in windows of `window` blocks: token folders
    (several: drawn by their weights), or documents tokenized on the fly."""
    section = plan.section
    vocab = len(tokenizer) if tokenizer is not None else None
    if plan.stored is not None:
        return StoredRows(plan.stored, section.seq_len, worker, plan.first_row, plan.stored_rows, vocab)
    if plan.folders:
        streams = [
            FolderStream(folder, plan.folder_shards(i), section.seq_len, plan.seed, worker, window, vocab=vocab)
            for i, folder in enumerate(plan.folders)
        ]
        if len(streams) == 1:
            return streams[0]
        return FolderMixture(streams, [s.weight for s in section.train], plan.seed, worker)
    return text_or_examples(train_documents(plan, worker, shuffle=window > 1), tokenizer, section, window)


def text_or_examples(docs: DocumentStream, tokenizer: Any, section: DataSection, window: int) -> BlockStream:
    """Packed text blocks, instruction examples with their loss masks, or preference pairs."""
    if section.preference_data:
        return PreferenceStream(docs, tokenizer, section.seq_len, window)
    if section.instruction_data:
        return ExampleStream(docs, tokenizer, section.seq_len, window, section.packing)
    return BlockStream(docs, tokenizer, section.seq_len, window)


def train_documents(
    plan: DataPlan, worker: Worker = Worker(), loop: bool = True, shuffle: bool = True
) -> DocumentStream:
    section = plan.section
    return DocumentStream(
        plans=plan.train,
        seed=plan.seed,
        worker=worker,
        holdout_every=0 if plan.validation else section.holdout_every,
        split="train",
        shuffle=shuffle,
        loop=loop,
        bad=BadRecords(section.on_bad_record),
    )


def first_documents(plan: DataPlan, n: int) -> Iterator[str]:
    """The first n training documents in a fixed order (for learning a tokenizer)."""
    if plan.folders:
        raise HftrainError(
            "tokenizer.train: the training data is pre-tokenized, so there is no text to learn from; use the tokenizer "
            f"it was made with: {plan.folder_note()}."
        )
    stream = train_documents(plan, loop=False)
    stream.shuffle = False
    for i, text in enumerate(stream.documents(stream.fresh_state())):
        if i >= n:
            return
        yield text


class PackedDataset(IterableDataset):
    """One rank's share of the run's global block order (readers.py): each DataLoader worker serves its slot's
    readers in turn, so the rank's samples come out in the same order for any worker count."""

    def __init__(
        self, plan: DataPlan, tokenizer: Any, rank: int, layout: ReaderLayout, resume: dict[str, Any] | None = None
    ):
        self.plan, self.tokenizer, self.rank, self.layout = plan, tokenizer, rank, layout
        self.resume = resume or {"blocks": 0, "positions": {}}

    @property
    def consumed(self) -> int:
        """Samples this rank had taken before this iteration began."""
        return int(self.resume["blocks"]) // self.layout.processes

    def __iter__(self) -> Iterator[tuple[int, Any, Any]]:
        info = get_worker_info()
        workers = info.num_workers if info else 1
        if workers != self.layout.workers:
            raise HftrainError(
                f"internal: the reader layout expects {self.layout.workers} worker(s), the DataLoader has {workers}"
            )
        slot = ((info.id if info else 0) + self.consumed) % workers
        streams = []
        for reader in self.layout.slot_readers(self.rank, slot, self.consumed):
            stream = train_blocks(
                self.plan, self.tokenizer, Worker(index=reader, count=self.layout.readers), self.layout.window
            )
            state = self.resume["positions"].get(str(reader)) or stream.fresh_state()
            streams.append((reader, stream.blocks(state)))
        while True:
            for reader, blocks in streams:
                item = next(blocks, None)
                if item is None:
                    return
                # numpy, pickled to the main process (no shared-memory tensor per sample)
                yield (reader, item[0], item[1])


def as_sample(block: Any) -> dict[str, Any]:
    """A text block (labels = inputs), an instruction block (3 rows: ids, labels, position ids), a stored row
    (inputs row[:-1], targets row[1:] as transformers' shift_labels: labels are then not read by the loss) or a
    preference pair (id lists, for TRL's collator)."""
    if isinstance(block, dict):
        return block
    if isinstance(block, StoredRow):  # seq_len + 1 tokens: seq_len inputs, each predicting the next token
        row = torch.from_numpy(block.tokens.astype("int64", copy=False))  # the readers' rows are int64 already
        return {"input_ids": row[:-1], "labels": row[:-1].clone(), "shift_labels": row[1:].clone()}
    block = torch.from_numpy(block.astype("int64", copy=False))
    if block.dim() == 2:
        return {"input_ids": block[0], "labels": block[1], "position_ids": block[2]}
    return {"input_ids": block, "labels": block.clone()}


def collator_for(section: DataSection, kernel: str, eos: int, form: str | None = None) -> PackedCollator:
    """The batches that keep the recipe's documents apart on `kernel` (packed_batch.py; `form`: another form, to
    show what a kernel would get from it). A kernel hftrain knows no form for (a checkpoint's own code may name
    one) is refused where documents share blocks, and gets plain rows where they do not."""
    if form is None and kernel not in KERNEL_FORMS:
        if section.packs_documents:
            raise HftrainError(
                f"model.attn_implementation: the model computes attention with {kernel!r}, and hftrain knows no batch "
                "form that keeps packed documents apart on it; set model.attn_implementation to one of "
                f"{', '.join(KERNEL_FORMS)}"
                + (", or data.packing: false" if section.instruction_data else ", or remove data.document_masking")
                + "."
            )
        form = ROWS
    return PackedCollator(kernel, eos if section.document_masking and not section.instruction_data else None, form)


def _as_is(item: Any) -> Any:
    return item


@dataclass(frozen=True)
class Placement:
    """Where the loader leaves its batches. On CUDA, in pinned host memory (TrainingArguments' dataloader_pin_memory)
    and, with accelerator_config.non_blocking, already on the device by a copy the host does not wait for (accelerate
    does the same for the loaders it prepares; this one it does not prepare): the Trainer's own copy of a batch
    waits for every kernel queued before it. Elsewhere the batch is left as it is."""

    device: torch.device | None = None
    pin_memory: bool = False
    non_blocking: bool = False

    @classmethod
    def of(cls, args: Any) -> Placement:
        """From TrainingArguments: its device, dataloader_pin_memory and accelerator_config.non_blocking."""
        config = args.accelerator_config
        non_blocking = (
            config.get("non_blocking") if isinstance(config, dict) else getattr(config, "non_blocking", False)
        )
        return cls(args.device, bool(args.dataloader_pin_memory), bool(non_blocking))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self.device is None or self.device.type != "cuda":
            return batch
        if self.pin_memory:
            batch = {k: pinned(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if not self.non_blocking:
            return batch
        from accelerate.utils import send_to_device

        return send_to_device(batch, self.device, non_blocking=True)


def pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


class ResumableLoader:
    """The rank's samples, batched in the main process; keeps each reader's latest position for checkpoints."""

    def __init__(
        self,
        dataset: PackedDataset,
        batch_size: int,
        num_workers: int,
        prefetch_factor: int | None = None,
        collate: Any = None,
        pad: int = 0,
        placement: Placement = Placement(),
        record: Any = None,
    ):
        self.dataset, self.batch_size, self.num_workers = dataset, batch_size, num_workers
        self.record = record  # step_batch.ConsumedRecord (data.record_batches), or None
        self.placement = placement
        self.prefetch_factor = prefetch_factor
        self.collate = collate or PackedCollator()
        self.samples = dataset.consumed
        self.positions: dict[str, Any] = dict(dataset.resume["positions"])
        self.pad = pad
        self.tokens = {"real": 0, "block": 0}  # this process's blocks since it started: the packing fill

    @property
    def fill(self) -> float | None:
        """The share of the block tokens this process read that are real tokens, not padding."""
        return self.tokens["real"] / self.tokens["block"] if self.tokens["block"] else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        layout = self.dataset.layout
        self.dataset.resume = {"blocks": self.samples * layout.processes, "positions": dict(self.positions)}
        loader = DataLoader(
            self.dataset,
            batch_size=None,  # one sample at a time: worker k % W gives sample k, whatever the micro-batch
            num_workers=self.num_workers,
            collate_fn=_as_is,
            prefetch_factor=(self.prefetch_factor or 2) * self.batch_size if self.num_workers else None,
            persistent_workers=False,
        )
        batch, raw = [], []
        for reader, block, position in loader:
            self.positions[str(reader)] = position
            self.samples += 1
            sample = as_sample(block)
            if "input_ids" in sample:
                self.tokens["real"] += real_tokens(
                    sample["labels"], sample["input_ids"], sample.get("position_ids"), self.pad
                )
                self.tokens["block"] += sample["input_ids"].numel()
            else:  # a pair: padded to its batch's longest, not to a block
                self.tokens["real"] += pair_tokens(sample)
            batch.append(sample)
            raw.append(block)
            if len(batch) == self.batch_size:
                if self.record is not None:
                    self.record.write(self.samples - len(raw), raw)
                batch, raw = self.collate(batch), []
                if "completion_mask" in batch:  # pairs: the positions the policy reads, padding included
                    self.tokens["block"] += batch["input_ids"].numel()
                yield self.placement(batch)
                batch = []

    def state_dict(self) -> dict[str, Any]:
        layout = self.dataset.layout
        return rank_state(layout, self.dataset.rank, self.samples, self.positions, self.dataset.plan.section.seq_len)


def first_pairs(plan: DataPlan, n: int) -> list[dict[str, Any]]:
    """The first n training pairs in a fixed order (what TRL checks its training set by)."""
    stream = train_documents(plan, loop=False, shuffle=False)
    return records(stream, n)
