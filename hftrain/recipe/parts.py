"""What each component reads of the recipe: one frozen part per component, holding only the sections (and the
few values derived from them) that component needs, built from a Recipe by its ``of``.

The resolver (training/resolve.py) builds them once per run and hands each to its component with the runtime
objects it needs (training/run.py: the run, one build after another); a component imports its part, never the
Recipe, so what it can depend on is written in one place and a newcomer reads a component without the whole schema.
One layer: a part holds recipe sections whole where it can, so a new key of a section reaches its component through
the section alone (README: "Adding a recipe key").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hftrain.recipe.objectives import OBJECTIVES, Objective
from hftrain.recipe.sections import LrScheduleSection, SpeedSection

if TYPE_CHECKING:
    from hftrain.data.loader import DataPlan
    from hftrain.recipe.data_section import DataSection, Source
    from hftrain.recipe.finetune_section import FinetuneSection
    from hftrain.recipe.schema import ModelSection, Recipe, TokenizerSection
    from hftrain.recipe.sections import CheckpointsSection, FaultsSection, HubSection, MonitorSection, ProfileSection
    from hftrain.recipe.training_section import TrainingSection


@dataclass(frozen=True)
class ModelPart:
    """What building the model reads (model/build.py), and with it what its tokenizer (model/tokenizer.py) and its
    fine-tuning method (model/finetune.py) read: the model, tokenizer and finetune sections, data.seq_len (checked
    against the model's context, and in its FLOPs), training.seed (a preset's init, an adapter's) and
    parallelism.max_memory (device_map's placement)."""

    model: ModelSection
    tokenizer: TokenizerSection
    finetune: FinetuneSection
    seq_len: int
    seed: int
    max_memory: dict[Any, Any] | None = None

    @classmethod
    def of(cls, recipe: Recipe) -> ModelPart:
        m, tok, ft = recipe.model, recipe.tokenizer, recipe.finetune
        return cls(
            m, tok, ft, seq_len=recipe.data.seq_len, seed=recipe.training.seed, max_memory=recipe.parallelism.max_memory
        )

    @property
    def from_pretrained(self) -> str | None:
        return self.model.from_pretrained

    @property
    def preset(self) -> str | None:
        return self.model.preset

    @property
    def objective(self) -> Objective:
        """What finetune.objective means for the model, its data and its Trainer (recipe/objectives.py)."""
        return OBJECTIVES[self.finetune.objective]


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
    memory_check: str = (
        "refuse"  # parallelism.memory_check: a certain out-of-memory is refused, or warned (planning/fit.py)
    )

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
        """The recipe as a run with this batch runs it (what its checkpoints record): unchanged when it is the recipe's
        own."""
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
    training.num_train_epochs (when written), data.seq_len, checkpoints.steps (each must be reached) and
    data.start_step (the corpus step a stored-order run begins at)."""

    max_steps: int | None
    train_tokens: int | None
    epochs: float | None
    epochs_given: bool
    seq_len: int
    kept_steps: tuple[int, ...] = ()
    start_step: int = 0  # data.start_step (stored order): where in the corpus the run's steps begin

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
            start_step=recipe.data.start_step or 0,
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
    push_to_hub: bool = False  # training.push_to_hub: the final model (and revisions) to the Hub, by hftrain

    @classmethod
    def of(cls, recipe: Recipe) -> PublishPart:
        m, data = recipe.model, recipe.data
        return cls(
            push_to_hub=bool(recipe.training_kwargs().get("push_to_hub", False)),
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
class DataPart:
    """What `hftrain data prepare` and `hftrain data inspect` read (data/prepare.py, inspect.py, packing_check.py):
    the data section, training.seed (the order the sources are read in), the micro-batch size
    (training.per_device_train_batch_size: --check-packing's batch) and the model's part (its tokenizer, its shape)."""

    data: DataSection
    seed: int
    batch_size: int
    model: ModelPart

    @classmethod
    def of(cls, recipe: Recipe) -> DataPart:
        t = recipe.training
        return cls(data=recipe.data, seed=t.seed, batch_size=t.per_device_train_batch_size, model=ModelPart.of(recipe))


@dataclass(frozen=True)
class TrainerPart:
    """What the Trainer and its callbacks read (training/trainer_build.py, objectives.py, dpo.py): the run's data
    plan (the resolver's, data/loader.py), the validation set's size for its progress line (data.eval_blocks,
    data.seq_len), training.logging_nan_inf_filter, the monitor section (metrics, evaluation tasks, sample, plot), the
    faults section (the non-finite guard), which checkpoints are kept (the checkpoints section), the profile section,
    the model's part (DPO builds its adapter, or its reference copy, from it), the model's FLOPs per token (the
    MFU), and the lr_schedule section with the step it starts at (data.start_step, where the data section has it:
    a run that continues another at its step N)."""

    data: DataPlan
    monitor: MonitorSection
    faults: FaultsSection
    kept: CheckpointsSection
    profile: ProfileSection
    model: ModelPart
    flops_per_token: float
    nan_filter: bool = True  # training.logging_nan_inf_filter, done on the device (training/arguments.py)
    lr_schedule: LrScheduleSection = field(default_factory=LrScheduleSection)
    schedule_first_step: int = 0

    @classmethod
    def of(cls, recipe: Recipe, data: DataPlan, flops_per_token: float) -> TrainerPart:
        nan_filter = recipe.training.logging_nan_inf_filter is not False
        model = ModelPart.of(recipe)
        return cls(
            data,
            recipe.monitor,
            recipe.faults,
            recipe.checkpoints,
            recipe.profile,
            model,
            flops_per_token,
            nan_filter,
            lr_schedule=recipe.lr_schedule,
            schedule_first_step=recipe.data.start_step or 0,
        )

    @property
    def objective(self) -> Objective:
        return self.model.objective

    @property
    def seq_len(self) -> int:
        return self.data.section.seq_len


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
class PlanPart:
    """What a run's plan on paper reads: the peak-memory prediction (planning/memory.py: the finetune section, the
    data section, the training section, parallelism.strategy, model.attn_implementation), `hftrain plan`'s estimates
    (planning/estimates.py: the model's part, measured from its config; the batch, for the tokens per step; the run
    length, for the planned steps), the checks made once before a run's processes start (launch/processes.py,
    script_checks.py: the method against the backend, the precision of a CPU rehearsal, the checkpoint the run would
    resume, an elastic launch's batch, the memory fit) and `hftrain parity`'s runs (launch/parity.py: the batch it
    splits over 2 processes, training.output_dir, the data section and training.seed)."""

    finetune: FinetuneSection
    data: DataSection
    training: TrainingSection
    strategy: str
    attention: str | None
    model: ModelPart
    batch: BatchPart
    run_length: RunLengthPart

    @classmethod
    def of(cls, recipe: Recipe) -> PlanPart:
        p, m = recipe.parallelism, recipe.model
        return cls(
            recipe.finetune,
            recipe.data,
            recipe.training,
            strategy=p.strategy,
            attention=m.attn_implementation,
            model=ModelPart.of(recipe),
            batch=BatchPart.of(recipe),
            run_length=RunLengthPart.of(recipe),
        )

    @property
    def training_kwargs(self) -> dict[str, Any]:
        """The TrainingArguments keys the recipe sets (Recipe.training_kwargs)."""
        return self.training.model_dump(exclude_unset=True)

    @property
    def output_dir(self) -> str:
        return self.training.output_dir

    @property
    def seed(self) -> int:
        return self.training.seed


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
