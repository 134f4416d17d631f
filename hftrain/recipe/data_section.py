"""The recipe's ``data`` section: its sources (local files, s3:// and other fsspec URLs, HF datasets, built-in text,
token folders), how they are read and mixed, blocks, packing, held-out validation and the run's token budget."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hftrain.recipe.sections import Section

ORIGINS = ("path", "dataset", "builtin", "pretokenized", "megatron")  # where a Source's documents come from


# ------------------------------------------------------------------------------------------------ data


class Source(Section):
    """One stream of documents. Give exactly one of path, dataset, builtin, pretokenized or megatron."""

    path: str | None = None
    """A file, directory or glob (local, file://, s3://, ...): .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet."""
    dataset: str | None = None
    """A Hugging Face datasets name or local dataset script/dir, read with load_dataset(streaming=True)."""
    dataset_config: str | None = None
    """The dataset's configuration name (load_dataset's second argument)."""
    split: str = "train"
    """The split of `dataset` to read."""
    builtin: Literal["python-docs"] | None = None
    """Text that ships with every Python: python-docs is the docstrings of the standard library (PSF license)."""
    pretokenized: str | None = None
    """A token folder in datatrove's tokenized layout (*.ds, *.ds.index, *.ds.metadata), local or a URL: written by
    `hftrain data prepare` or by datatrove's DocumentTokenizer. Read in blocks of data.seq_len without tokenizing;
    several, with weights, are a mixture."""
    megatron: str | None = None
    """A Megatron / gpt-neox indexed corpus: PREFIX (PREFIX.idx beside PREFIX.bin, or beside the .bin's shards
    PREFIX-NNNNN-of-MMMMM.bin, as Pythia's preshuffled Pile comes), local or a URL, read in place by byte range. Read
    in the stored order (data.order: stored: item i is the i-th training sequence of seq_len + 1 tokens), or as
    blocks of its tokens like a token folder (several, with weights, are a mixture)."""
    text_field: str = "text"
    """The column/key holding the text (jsonl, parquet, datasets)."""
    document_boundary: Literal["file", "blank_line", "line"] = "file"
    """Plain text files: file = each file is one document (one EOS at its end); blank_line = documents are
    separated by one or more empty lines; line = each non-empty line is a document. Files are read in
    bounded pieces whatever their size, and a long document is tokenized in pieces cut where the tokenizer's
    pre-tokenizer splits, so its tokens are those of the whole document."""
    format: Literal["auto", "txt", "jsonl", "parquet", "prompt_completion", "chat", "preference"] = "auto"
    """File format; auto decides by extension (.gz/.zst compression is always detected). prompt_completion
    (JSONL with prompt and completion) and chat (JSONL with messages) are instruction data: the loss is on the
    completion / assistant tokens only. preference: pairs for finetune.objective dpo, JSONL (or a dataset) with
    prompt, chosen and rejected strings, or chosen and rejected message lists (an optional prompt list first)."""
    prompt_field: str = "prompt"
    """prompt_completion: the key of the prompt."""
    completion_field: str = "completion"
    """prompt_completion: the key of the completion."""
    messages_field: str = "messages"
    """chat: the key of the list of {role, content} messages."""
    chosen_field: str = "chosen"
    """preference: the key of the preferred answer (a string, or a list of messages)."""
    rejected_field: str = "rejected"
    """preference: the key of the answer that is not preferred."""
    weight: float = Field(default=1.0, gt=0)
    """Relative share of this source in a mixture."""
    storage_options: dict[str, Any] = {}
    """fsspec options for this source's URL, e.g. {endpoint_url: http://host:9000} for an S3-compatible store.
    By default s3:// credentials and endpoint come from the standard AWS environment and config, gs:// ones from
    the standard Google environment (GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server; {token: anon} for public
    data)."""

    def identity(self) -> tuple[str, ...]:
        """What this source reads, whatever the spelling (a local path normalised, a URL as given), with the fields
        that change what is read (the split, the text field, the format)."""
        for kind in ("pretokenized", "megatron", "path", "dataset", "builtin"):
            value = getattr(self, kind)
            if value:
                where = value if "://" in value or kind in ("dataset", "builtin") else os.path.abspath(value)
                return (kind, where, self.dataset_config or "", self.split, self.text_field, self.format)
        return ("", "")

    @model_validator(mode="after")
    def _exactly_one_origin(self) -> Source:
        given = [k for k in ORIGINS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(ORIGINS[:-1])} or {ORIGINS[-1]} (got {', '.join(given) or 'none'})"
            )
        return self

    @property
    def tokens(self) -> str | None:
        """What kind of token files this source is (pretokenized or megatron), None for text."""
        return "pretokenized" if self.pretokenized else "megatron" if self.megatron else None


def data_kind(fmt: str) -> str:
    """text, instruction (prompt_completion, chat) or preference: what a source's records are."""
    return "instruction" if fmt in ("prompt_completion", "chat") else "preference" if fmt == "preference" else "text"


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


MAX_SEQ_LEN = 2**20  # a million tokens per sequence: beyond any NeoX context, and any one GPU's activations


MAX_TRAIN_TOKENS = 10**15  # about 30x the largest published pretraining runs: a bigger number is a typo, not a plan


class DataSection(Section):
    """Where the text comes from and how it becomes fixed-length training blocks."""

    train: list[Source] = [Source(builtin="python-docs")]
    """Training source, or a list of sources (a mixture)."""
    validation: Source | None = None
    """A separate validation source. When given, no training data is held out."""
    holdout_every: int = Field(default=50, ge=2)
    """Without a validation source, every N-th training document is held out for validation."""
    eval_blocks: int = Field(default=32, gt=0)
    """How many seq_len blocks the validation set holds (read once, kept in memory)."""
    train_tokens: int | None = Field(default=None, gt=0)
    """Size the run in tokens instead of steps: max_steps = ceil(train_tokens / (global batch x seq_len)).
    training.max_steps, when also set, wins (see docs/recipes-and-data.md, "Run length")."""
    seq_len: int = Field(default=256, gt=1)
    """Tokens per training block. Documents are joined with EOS and cut into blocks of exactly this length."""
    shuffle_window: int | None = Field(default=None, ge=1)
    """Blocks each logical reader shuffles together (deterministic from training.seed); 1 disables shuffling.
    Default: about 4M tokens over all readers (8,192 blocks per reader at seq_len 64 with 8 readers, 256 at
    2048), fixed at the run's start. Bigger mixes more documents; the first step and a resume tokenize one window."""
    packing: bool = True
    """Instruction data: pack several short examples into one block (best fit within each shuffle window; each
    attends only to itself, on every attention kernel); false pads each example to seq_len instead."""
    document_masking: bool | None = None
    """Each document attends only to itself (and its first token is not predicted from the one before). Default:
    on for packed instruction examples, off for pretraining text (documents joined with EOS attend to the ones
    before them in their block, as Pythia was trained). `hftrain data inspect RECIPE --check-packing` checks it."""
    readers: int | None = Field(default=None, gt=0)
    """Logical readers, each owning an equal share of every source (whole shards, or a part of each); fixed at the
    run's start. The data order (and so the losses) is the same on any launch whose processes x dataloader
    workers divides it, and a checkpoint resumes onto any such launch. Default: 8 (fewer if a source has fewer
    shards), times whatever the first launch needs."""
    order: Literal["shuffled", "stored"] = "shuffled"
    """shuffled: blocks shuffled in windows (data.shuffle_window) by training.seed. stored: a Megatron corpus
    (data.train: {megatron: PREFIX}) read in its own order, as Pythia was trained: item i is the i-th training
    sequence of seq_len + 1 tokens (inputs row[:-1], targets row[1:]), and step s of a global batch of B
    sequences trains items [B·s, B·(s+1)) on any launch. `hftrain data batch RECIPE --step N` prints them."""
    start_step: int | None = Field(default=None, ge=0)
    """With data.order: stored, the corpus step this run's first step is: it begins at item B·start_step without
    reading what lies before it. Default: N when model.revision is Pythia's `stepN`, else 0. The run's steps,
    its schedule (lr_schedule) and results.json count on from there."""
    record_batches: bool = False
    """Write what every micro-batch trained on into output_dir/batches/rank-P.jsonl: each sequence's global block,
    a digest of its tokens (and its item, in stored order), the names `hftrain data batch` prints."""
    on_bad_record: Literal["fail", "skip"] = "fail"
    """A malformed record (bad JSON line, missing text field): fail names file and line; skip counts and goes on."""

    _wrap_train = field_validator("train", mode="before")(_as_list)

    @field_validator("train")
    @classmethod
    def _some_training_data(cls, sources: list[Source]) -> list[Source]:
        if not sources:
            raise ValueError(
                "an empty list: give at least one source, e.g. {path: data.jsonl} or {builtin: python-docs}"
            )
        return sources

    @field_validator("seq_len", "train_tokens")
    @classmethod
    def _within_reach(cls, value: int | None, info: Any) -> int | None:
        limit = {"seq_len": MAX_SEQ_LEN, "train_tokens": MAX_TRAIN_TOKENS}[info.field_name]
        if value is not None and value > limit:
            what = "tokens per sequence" if info.field_name == "seq_len" else "training tokens"
            raise ValueError(
                f"{value:,} {what} is more than hftrain trains (at most "
                f"{limit:,}); check the number (a misplaced exponent?)"
            )
        return value

    @model_validator(mode="after")
    def _each_source_once(self) -> DataSection:
        """A source listed twice in a mixture is read twice as often, silently: its weight says that."""
        seen: dict[tuple[str, ...], int] = {}
        for i, source in enumerate(self.train):
            key = source.identity()
            if key in seen:
                where = f"train[{seen[key]}] and train[{i}]"
                raise ValueError(
                    f"{where} are the same source ({key[1]}): listed twice, it would be read twice as often. Give it "
                    f"once, with weight: {self.train[seen[key]].weight + source.weight:g} to draw from it that often"
                )
            seen[key] = i
        return self

    @model_validator(mode="after")
    def _one_kind_of_data(self) -> DataSection:
        if len({s.tokens for s in self.train}) > 1:
            raise ValueError(
                "train: token folders (pretokenized) and Megatron corpora (megatron) mix only with sources of their "
                "own kind; prepare the text sources too (`hftrain data prepare`), or give only text sources"
            )
        self._stored_order()
        kinds = {data_kind(s.format) for s in self.train + ([self.validation] if self.validation else [])}
        if len(kinds) > 1:
            raise ValueError(
                f"train/validation: {' and '.join(sorted(kinds))} data cannot be mixed; give sources of one kind "
                "(plain text, instruction data: prompt_completion or chat, or preference pairs)"
            )
        if self.document_masking is False and self.packing and self.instruction_data:
            raise ValueError(
                "document_masking: false would let packed instruction examples attend to each other; remove "
                "it (examples are always kept apart), or set data.packing: false to pad each example instead"
            )
        return self

    def _stored_order(self) -> None:
        """data.order: stored reads one Megatron corpus row by row: nothing to shuffle, mix or mask."""
        if self.order != "stored":
            if self.start_step is not None:
                raise ValueError(
                    "start_step: a run begins at a corpus step only in data.order: stored (a Megatron corpus read "
                    "in its own order); remove data.start_step, or set data.order: stored"
                )
            return
        if len(self.train) != 1 or self.train[0].megatron is None:
            raise ValueError(
                "order: stored reads one Megatron corpus in its own order; give data.train: {megatron: PREFIX} "
                "alone (a mixture or other sources are read shuffled: data.order: shuffled)"
            )
        if self.shuffle_window not in (None, 1):
            raise ValueError(
                f"shuffle_window: {self.shuffle_window} with data.order: stored, which never shuffles; remove "
                "data.shuffle_window, or set data.order: shuffled"
            )
        if self.document_masking:
            raise ValueError(
                "document_masking with data.order: stored: its rows are trained whole, as Pythia's were; remove "
                "data.document_masking, or set data.order: shuffled"
            )
        self.shuffle_window = 1

    @property
    def instruction_data(self) -> bool:
        return data_kind(self.train[0].format) == "instruction"

    @property
    def preference_data(self) -> bool:
        return data_kind(self.train[0].format) == "preference"

    @property
    def packs_documents(self) -> bool:
        """Whether one block may hold several documents that must not see each other."""
        return bool(self.document_masking) or (self.instruction_data and self.packing)

    @property
    def masks_documents(self) -> bool:
        """Whether each document (instruction example) attends only to itself."""
        return self.instruction_data or bool(self.document_masking)
