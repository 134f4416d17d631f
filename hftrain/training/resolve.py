"""The recipe resolved once: a pure function from (the recipe, the launch read once, what a continuing run
recorded at its start) to a frozen `RunSpec`: each component's part (`XPart.of(recipe)`, defined beside the
component it builds: model/part.py, checkpoint/part.py, training/trainer_build.py, integrations/publish.py, ...) with
what the resolver derived for it, and what the run became for the caller (`AsRun`).

Everything a run derives is derived here, each in one place: the strategy (parallel/dims.py), the global batch
(dims.global_batch), the memory fit (planning/fit.py: a batch, never a new recipe), the run length
(planning/run_length.py: RunLengthPart.build), where the run resumes and its directory (CheckpointPart.of: the
resume setting parsed once by ResumeSetting.of) and the TrainingArguments values. Resolving reads (the recipe, the
environment, the model's config, the token folders, the machine's memory) but changes nothing: what a run then sets
up, process groups, patches, the speed probe, is `training/run.py`'s set-up. Each component gets its part, never
the recipe; `hftrain plan` shares the same strategy, global batch and fit functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hftrain.checkpoint.part import CheckpointPart
from hftrain.data.loader import DataPlan, plan_data
from hftrain.integrations.publish import PublishPart
from hftrain.model import attention
from hftrain.model.finetune import check_starting_weights
from hftrain.model.part import ModelPart
from hftrain.model.shape import ModelShape, measure_model
from hftrain.parallel import dims as parallel
from hftrain.parallel.batch import BatchPart, global_batch
from hftrain.parallel.dims import LaunchEnv, ParallelDims, Strategy
from hftrain.parallel.readers import default_readers, default_workers
from hftrain.planning.part import PlanPart
from hftrain.planning.run_length import RunLength, RunLengthPart
from hftrain.recipe.data_section import DataSection
from hftrain.recipe.report_to import check_installed
from hftrain.recipe.schema import Recipe
from hftrain.speed.defaults import SpeedPart
from hftrain.training import resumed_settings
from hftrain.training.arguments import argument_values
from hftrain.training.run_record import AsRun
from hftrain.training.trainer_build import TrainerPart


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: the launch, what the run became (for the caller), what the resolver derived (the
    TrainingArguments values, the dims, the model's shape, the run length) and each component's part."""

    launch: LaunchEnv
    fit_note: str | None  # parallelism.fit_memory's choice, or the warning that the recipe's batch will not fit
    as_run: AsRun  # what the run became: the layout the resolver chose, its length, the recipe as run
    arguments: Mapping[str, Any]  # TrainingArguments values before the set-up's measurements (read-only)
    recorded: Mapping[str, Any]  # what a continuing run recorded at its start (its speed levers are kept)
    dims: ParallelDims
    shape: ModelShape
    length: RunLength
    network_timeout_s: float  # faults.network_timeout_s: every network client's bound
    speed: SpeedPart
    model: ModelPart
    checkpoints: CheckpointPart
    trainer: TrainerPart
    publish: PublishPart

    @property
    def data(self) -> DataPlan:
        return self.trainer.data


def recorded_start(recipe: Recipe) -> dict[str, Any]:
    """What a continuing run in the recipe's output_dir recorded at its start (empty for a new run)."""
    return CheckpointPart.of(recipe).build(None).recorded_start()


def resolve(recipe: Recipe, launch: LaunchEnv, recorded: dict[str, Any]) -> RunSpec:
    """The run's spec; `recorded` keeps a continuing run's global batch, readers and speed levers."""
    check_installed(recipe.training.report_to)  # a tracker's library, before anything is measured or written
    check_starting_weights(ModelPart.of(recipe))
    cpu = launch.device == "cpu" or bool(recipe.training_kwargs().get("use_cpu"))
    attention.check_trains_here(recipe.model.attn_implementation, "cpu" if cpu else launch.device)
    shape = measure_model(ModelPart.of(recipe))  # on the meta device: nothing is loaded
    strategy = parallel.resolve_strategy(recipe.parallelism.strategy, launch)
    # the memory fit on paper, before the data's shards are listed: a certain out-of-memory is refused first (fit.py)
    batch, fit_note = fit_batch(recipe, launch, strategy, shape, recorded.get("global_batch"))
    data = plan_data(recipe.data, recipe.training.seed)
    recipe = with_batch(recipe, batch)  # from here on, the recipe as this run runs it
    kwargs = recipe.training_kwargs()
    workers = loader_workers(kwargs, launch, recipe.data, recorded, data.reader_limit)
    if "dataloader_num_workers" not in kwargs and workers:
        kwargs["dataloader_num_workers"] = workers  # the arguments say what the dims and the loader use
    dims = parallel.resolve(launch, strategy, batch, recipe.data, recorded, data.reader_limit, workers)
    length = RunLengthPart.of(recipe).build(dims.global_batch, data.folder_tokens)
    data = data.starting_at(dims.global_batch)  # a stored-order run begins at data.start_step's items
    data.check_reach(length.max_steps, dims.global_batch)
    checkpoints = CheckpointPart.of(recipe)
    spec = RunSpec(
        launch=launch,
        fit_note=fit_note,
        as_run=became(dims, batch, length, checkpoints.recipe_yaml),
        arguments=MappingProxyType(argument_values(kwargs, dims, length, launch.device)),
        recorded=MappingProxyType(recorded),
        dims=dims,
        shape=shape,
        length=length,
        network_timeout_s=recipe.faults.network_timeout_s,
        speed=SpeedPart.of(recipe),
        model=ModelPart.of(recipe),
        checkpoints=checkpoints,
        trainer=TrainerPart.of(recipe, data, shape.flops_per_token),
        publish=PublishPart.of(recipe),
    )
    checkpoints.build(None).check_same_run()  # before the probe and the model
    resumed = checkpoints.resume.checkpoint_in(checkpoints.output_dir)
    resumed_settings.check_unchanged(kwargs, resumed)  # a refused change, before it too
    parallel.check_deepspeed_schedule(spec.arguments.get("deepspeed"), recipe.lr_schedule.type)
    return spec


def with_batch(recipe: Recipe, batch: BatchPart) -> Recipe:
    """The recipe as a run with this batch runs it (what its checkpoints record): unchanged when it is the recipe's
    own (the memory fit may choose another micro-batch, accumulation or checkpointing: planning/fit.py)."""
    if batch == BatchPart.of(recipe):
        return recipe
    training = recipe.training.model_copy(
        update={
            "per_device_train_batch_size": batch.micro_batch,
            "per_device_eval_batch_size": batch.eval_batch,
            "gradient_accumulation_steps": batch.accumulation,
            "gradient_checkpointing": batch.gradient_checkpointing,
        }
    )
    parallelism = recipe.parallelism.model_copy(update={"global_batch_size": batch.global_batch_size})
    return recipe.model_copy(update={"training": training, "parallelism": parallelism})


def became(dims: ParallelDims, batch: BatchPart, length: RunLength, recipe_yaml: str) -> AsRun:
    """What the recipe became in this run, for the caller (the Run record)."""
    return AsRun(
        strategy=dims.strategy.value,
        processes=dims.processes,
        micro_batch=dims.micro_batch,
        gradient_accumulation_steps=dims.accumulation,
        global_batch=dims.global_batch,
        gradient_checkpointing=batch.gradient_checkpointing,
        max_steps=length.max_steps,
        recipe_yaml=recipe_yaml,
    )


def loader_workers(
    kwargs: dict[str, Any], launch: LaunchEnv, data: DataSection, recorded: dict[str, Any], reader_limit: int | None
) -> int:
    """training.dataloader_num_workers; unset, 0 on a CPU (a worker would take a core from the matmuls) and on CUDA
    readers.default_workers: a divisor of the readers the run has without workers (recorded by a resumed run,
    data.readers, else the default), so the dims, the loader and the arguments agree and the data order is the same."""
    if "dataloader_num_workers" in kwargs:
        return int(kwargs["dataloader_num_workers"] or 0)
    if launch.device != "cuda" or kwargs.get("use_cpu"):
        return 0
    processes = launch.processes
    readers = recorded.get("readers") or data.readers or default_readers(reader_limit, processes, 1)
    return default_workers(readers, processes, launch.cpus // max(launch.local_processes, 1))


def fit_batch(
    recipe: Recipe, launch: LaunchEnv, strategy: Strategy, shape: ModelShape, recorded: int | None
) -> tuple[BatchPart, str | None]:
    """parallelism.fit_memory's micro-batch and checkpointing, or a warning when the recipe's will not fit (fit.py),
    at the run's global batch (a continuing run keeps the one it recorded at its start). A layout that would certainly
    run out of memory is an HftrainError here, before any tokenizer, model or data is loaded
    (parallelism.memory_check)."""
    batch = BatchPart.of(recipe)
    if strategy is Strategy.DEVICE_MAP:
        return batch, None
    from hftrain.planning.estimates import plan
    from hftrain.planning.fit import fit_this_run

    part = PlanPart.of(recipe)
    total = global_batch(batch, launch.processes, recorded, launch.elastic_most_nodes, launch.local_processes)
    name = "single" if strategy is Strategy.SINGLE else strategy.value
    fitted, note = fit_this_run(
        part, plan(part, shape), launch.processes, launch.local_processes, name, launch.device, total
    )
    if note and not batch.fit_memory and launch.memory_warned:
        note = None  # `hftrain train --accelerate-config` said it once before starting the processes
    return fitted, note
