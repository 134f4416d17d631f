"""What each component reads of the recipe: one frozen part per component, holding only the sections (and the
few values derived from them) that component needs, built from a Recipe by its ``of``.

The resolver (training/resolve.py) builds them once per run; a component imports its part, never the Recipe, so
what it can depend on is written in one place and a newcomer reads a component without the whole schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hftrain.recipe.sections import SpeedSection

if TYPE_CHECKING:
    from hftrain.recipe.finetune_section import FinetuneSection
    from hftrain.recipe.schema import DataSection, ModelSection, Recipe, Source, TokenizerSection
    from hftrain.recipe.sections import CheckpointsSection, EvalTask, HubSection
    from hftrain.recipe.training_section import TrainingSection


@dataclass(frozen=True)
class TokenizerPart:
    """What loading the run's tokenizer reads (model/tokenizer.py): the tokenizer section, and the model section for
    a from_pretrained model's own tokenizer (from_pretrained, revision, trust_remote_code)."""

    tokenizer: TokenizerSection
    model: ModelSection

    @classmethod
    def of(cls, recipe: Recipe) -> TokenizerPart:
        return cls(tokenizer=recipe.tokenizer, model=recipe.model)


@dataclass(frozen=True)
class FinetunePart:
    """What the fine-tuning method reads (model/finetune.py): the finetune section, the starting weights
    (model.from_pretrained, model.preset) and training.seed (the adapter's initialisation)."""

    finetune: FinetuneSection
    from_pretrained: str | None
    preset: str | None
    seed: int

    @classmethod
    def of(cls, recipe: Recipe) -> FinetunePart:
        m = recipe.model
        return cls(finetune=recipe.finetune, from_pretrained=m.from_pretrained, preset=m.preset, seed=recipe.training.seed)


@dataclass(frozen=True)
class ModelPart:
    """What building and measuring the model reads (model/build.py): the model, tokenizer and finetune sections,
    data.seq_len (checked against the model's context, and in its FLOPs) and training.seed (a preset's init)."""

    model: ModelSection
    tokenizer: TokenizerSection
    finetune: FinetuneSection
    seq_len: int
    seed: int

    @classmethod
    def of(cls, recipe: Recipe) -> ModelPart:
        m, tok, ft = recipe.model, recipe.tokenizer, recipe.finetune
        return cls(model=m, tokenizer=tok, finetune=ft, seq_len=recipe.data.seq_len, seed=recipe.training.seed)

    @property
    def tokenizing(self) -> TokenizerPart:
        """The tokenizer's part of it (the same sections)."""
        return TokenizerPart(tokenizer=self.tokenizer, model=self.model)

    @property
    def finetuning(self) -> FinetunePart:
        """The fine-tuning method's part of it (the same sections)."""
        return FinetunePart(finetune=self.finetune, from_pretrained=self.model.from_pretrained, preset=self.model.preset, seed=self.seed)


@dataclass(frozen=True)
class BatchPart:
    """The batch keys, from which parallel/dims.py alone derives the global batch: parallelism.global_batch_size and
    the training section's micro-batch, evaluation batch, accumulation and gradient checkpointing. The memory fit
    (planning/fit.py) answers with another BatchPart, never a new recipe."""

    global_batch_size: int | None
    micro_batch: int
    eval_batch: int
    accumulation: int | None  # training.gradient_accumulation_steps as the recipe gives it (None: unset)
    accumulation_given: bool  # written in the recipe (not only a default)
    gradient_checkpointing: bool
    fit_memory: bool  # parallelism.fit_memory: the fit may change the four above
    memory_check: str = "refuse"  # parallelism.memory_check: a certain out-of-memory is refused, or warned (planning/fit.py)

    @classmethod
    def of(cls, recipe: Recipe) -> BatchPart:
        kwargs, t = recipe.training_kwargs(), recipe.training
        return cls(
            global_batch_size=recipe.parallelism.global_batch_size,
            micro_batch=int(kwargs.get("per_device_train_batch_size", 8)),
            eval_batch=int(t.per_device_eval_batch_size),
            accumulation=kwargs.get("gradient_accumulation_steps"),
            accumulation_given="gradient_accumulation_steps" in t.model_fields_set,
            gradient_checkpointing=bool(t.gradient_checkpointing),
            fit_memory=recipe.parallelism.fit_memory,
            memory_check=recipe.parallelism.memory_check,
        )

    def applied_to(self, recipe: Recipe) -> Recipe:
        """The recipe as a run with this batch runs it (what its checkpoints record): unchanged when it is the recipe's own."""
        if self == BatchPart.of(recipe):
            return recipe
        training = recipe.training.model_copy(
            update={
                "per_device_train_batch_size": self.micro_batch,
                "per_device_eval_batch_size": self.eval_batch,
                "gradient_accumulation_steps": self.accumulation,
                "gradient_checkpointing": self.gradient_checkpointing,
            }
        )
        parallelism = recipe.parallelism.model_copy(update={"global_batch_size": self.global_batch_size})
        return recipe.model_copy(update={"training": training, "parallelism": parallelism})


@dataclass(frozen=True)
class RunLengthPart:
    """What the run's length is derived from (planning/run_length.py): training.max_steps, data.train_tokens,
    training.num_train_epochs (when written), data.seq_len, and checkpoints.steps (each must be reached)."""

    max_steps: int | None
    train_tokens: int | None
    epochs: float | None
    epochs_given: bool
    seq_len: int
    kept_steps: tuple[int, ...] = ()

    @classmethod
    def of(cls, recipe: Recipe) -> RunLengthPart:
        kwargs = recipe.training_kwargs()
        return cls(
            max_steps=kwargs.get("max_steps"),
            train_tokens=recipe.data.train_tokens,
            epochs=kwargs.get("num_train_epochs"),
            epochs_given="num_train_epochs" in recipe.training.model_fields_set,
            seq_len=recipe.data.seq_len,
            kept_steps=tuple(recipe.checkpoints.steps),
        )


@dataclass(frozen=True)
class CheckpointPart:
    """What the CheckpointManager reads (checkpoint/manager.py): the run's identity (model, tokenizer, data), the
    recipe as run (secrets removed) that each checkpoint carries, which checkpoints are kept, and whether the
    weights saved are the full model or an adapter on a recorded base."""

    identity: dict[str, str]
    recipe_yaml: str
    kept: CheckpointsSection
    save_total_limit: int | None
    base_model: str  # model.from_pretrained ("" for a model trained from scratch)
    full_weights: bool  # finetune.method full (else an adapter)

    @classmethod
    def of(cls, recipe: Recipe) -> CheckpointPart:
        from hftrain.recipe.load import fingerprint, recipe_to_dict
        from hftrain.recipe.yaml_io import dump_yaml

        return cls(
            identity=fingerprint(recipe),
            recipe_yaml=dump_yaml(recipe_to_dict(recipe)),
            kept=recipe.checkpoints,
            save_total_limit=recipe.training.save_total_limit,
            base_model=recipe.model.from_pretrained or "",
            full_weights=recipe.finetune.method == "full",
        )


@dataclass(frozen=True)
class PublishPart:
    """What sharing a model reads (integrations/hub.py, revisions.py): where it goes (the hub section: s3_uri,
    storage_options, the card's license and tags), which checkpoints are pushed as revisions (the checkpoints
    section), the bound of a later `hftrain push` (faults.network_timeout_s), and what the model card says of the
    run: its starting weights (model.from_pretrained, model.preset), its training sources (data.train, and whether
    they are instruction data) and how the weights were trained (the finetune section)."""

    hub: HubSection
    checkpoints: CheckpointsSection
    network_timeout_s: float
    from_pretrained: str | None
    preset: str | None
    train: tuple[Source, ...]
    instruction_data: bool
    finetune: FinetuneSection

    @classmethod
    def of(cls, recipe: Recipe) -> PublishPart:
        m, data = recipe.model, recipe.data
        return cls(
            hub=recipe.hub,
            checkpoints=recipe.checkpoints,
            network_timeout_s=recipe.faults.network_timeout_s,
            from_pretrained=m.from_pretrained,
            preset=m.preset,
            train=tuple(data.train),
            instruction_data=data.instruction_data,
            finetune=recipe.finetune,
        )


@dataclass(frozen=True)
class DataPrepPart:
    """What `hftrain data prepare` and `hftrain data inspect` read (data/prepare.py): the data section,
    training.seed (the order the sources are read in) and the tokenizer's part."""

    data: DataSection
    seed: int
    tokenizing: TokenizerPart

    @classmethod
    def of(cls, recipe: Recipe) -> DataPrepPart:
        return cls(data=recipe.data, seed=recipe.training.seed, tokenizing=TokenizerPart.of(recipe))


@dataclass(frozen=True)
class PackingCheckPart:
    """What `hftrain data inspect --check-packing` reads (data/packing_check.py): the data section, training.seed,
    the micro-batch size (training.per_device_train_batch_size) and the model's part (its shape, its tokenizer)."""

    data: DataSection
    seed: int
    batch_size: int
    model: ModelPart

    @classmethod
    def of(cls, recipe: Recipe) -> PackingCheckPart:
        t = recipe.training
        return cls(data=recipe.data, seed=t.seed, batch_size=t.per_device_train_batch_size, model=ModelPart.of(recipe))


@dataclass(frozen=True)
class TrainerPart:
    """What an objective's Trainer reads (training/objectives.py, dpo.py): the validation set's size for its
    progress line (data.eval_blocks, data.seq_len), the evaluation tasks (monitor.eval_tasks) and the model's part
    (DPO builds its adapter, or its reference copy, from it)."""

    eval_blocks: int
    seq_len: int
    eval_tasks: list[EvalTask]
    model: ModelPart

    @classmethod
    def of(cls, recipe: Recipe) -> TrainerPart:
        data = recipe.data
        return cls(eval_blocks=data.eval_blocks, seq_len=data.seq_len, eval_tasks=recipe.monitor.eval_tasks, model=ModelPart.of(recipe))


@dataclass(frozen=True)
class SageMakerPart:
    """What a SageMaker launch script checks (launch/sagemaker.py): every file the job would read, since a job
    cannot read this machine's: the data sources (data.train, data.validation), model.from_pretrained,
    tokenizer.path, and training.resume_from_checkpoint and training.deepspeed where the recipe sets them."""

    sources: tuple[Source, ...]
    from_pretrained: str | None
    tokenizer_path: str | None
    resume_from_checkpoint: object
    deepspeed: object

    @classmethod
    def of(cls, recipe: Recipe) -> SageMakerPart:
        data, training = recipe.data, recipe.training_kwargs()
        return cls(
            sources=(*data.train, *([data.validation] if data.validation else [])),
            from_pretrained=recipe.model.from_pretrained,
            tokenizer_path=recipe.tokenizer.path,
            resume_from_checkpoint=training.get("resume_from_checkpoint"),
            deepspeed=training.get("deepspeed"),
        )


@dataclass(frozen=True)
class MemoryPart:
    """What the peak-memory prediction reads (planning/memory.py): the finetune section (method, objective), the data
    section (seq_len, eval_blocks, documents kept apart, readers, shuffle window), the training section (batches,
    precision, gradient checkpointing, torch_compile, DataLoader workers), parallelism.strategy and
    model.attn_implementation."""

    finetune: FinetuneSection
    data: DataSection
    training: TrainingSection
    strategy: str
    attention: str | None

    @classmethod
    def of(cls, recipe: Recipe) -> MemoryPart:
        p = recipe.parallelism
        return cls(recipe.finetune, recipe.data, recipe.training, strategy=p.strategy, attention=recipe.model.attn_implementation)


@dataclass(frozen=True)
class PlanPart:
    """What `hftrain plan`'s estimates read (planning/estimates.py): the memory prediction's part (the finetune section,
    data.seq_len, the micro-batch), the model's part (measured on the meta device), the batch (the global batch,
    for the tokens per step) and the run length (the planned steps)."""

    memory: MemoryPart
    model: ModelPart
    batch: BatchPart
    run_length: RunLengthPart

    @classmethod
    def of(cls, recipe: Recipe) -> PlanPart:
        return cls(MemoryPart.of(recipe), ModelPart.of(recipe), BatchPart.of(recipe), RunLengthPart.of(recipe))


@dataclass(frozen=True)
class SpeedPart:
    """What the speed defaults read (speed/defaults.py): finetune.method (quantized and adapter runs keep fp32 and
    eager), data.seq_len (the speed probe's shape) and the recipe's speed section (the loss, FP8)."""

    method: str
    seq_len: int
    section: SpeedSection = field(default_factory=SpeedSection)

    @classmethod
    def of(cls, recipe: Recipe) -> SpeedPart:
        return cls(method=recipe.finetune.method, seq_len=recipe.data.seq_len, section=recipe.speed)


@dataclass(frozen=True)
class LaunchPart:
    """What is checked once before a run's processes start (launch/processes.py), so that a refusal is one message:
    the method against the backend, the precision of a CPU rehearsal, the checkpoint the run would resume, an elastic
    launch's batch and the memory fit (its plan part)."""

    finetune: FinetunePart
    training_kwargs: dict[str, object]
    output_dir: str
    plan: PlanPart

    @classmethod
    def of(cls, recipe: Recipe) -> LaunchPart:
        return cls(FinetunePart.of(recipe), recipe.training_kwargs(), recipe.training.output_dir, PlanPart.of(recipe))


@dataclass(frozen=True)
class ParityPart:
    """What `hftrain parity` reads of its recipe (launch/parity.py, elastic_parity.py): the batch it splits over 2
    processes, where its runs go, and the data section with the seed (the readers every run of --elastic shares)."""

    batch: BatchPart
    output_dir: str
    data: DataSection
    seed: int

    @classmethod
    def of(cls, recipe: Recipe) -> ParityPart:
        return cls(BatchPart.of(recipe), recipe.training.output_dir, recipe.data, recipe.training.seed)
