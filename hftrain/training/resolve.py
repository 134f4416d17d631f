"""The recipe resolved once: a pure function from (the recipe, the launch read once, what a continuing run
recorded at its start) to a frozen `RunSpec` of per-component parts.

Everything a run derives is derived here, each in one place: the strategy (parallel/dims.py), the global batch
(dims.global_batch), the memory fit (planning/fit.py: a batch, never a new recipe), the run length
(planning/run_length.py), the resume setting (training.resume_from_checkpoint, parsed by ResumeSetting.of) and the
TrainingArguments values. Resolving reads (the recipe, the environment, the model's config, the data's manifest,
the machine's memory) but changes nothing: what a run then sets up, process groups, patches, the speed probe, is
`training/run.py`'s set-up step. The components get their part (hftrain/recipe/parts.py), never the recipe;
`hftrain plan` shares the same strategy, global batch and fit functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import RunLayout
from hftrain.checkpoint.manager import CheckpointManager, ResumeSetting
from hftrain.data.loader import DataPlan, plan_data
from hftrain.model.build import ModelShape, measure_model
from hftrain.model.finetune import check_starting_weights
from hftrain.parallel import dims as parallel
from hftrain.parallel.dims import LaunchEnv, ParallelDims, Strategy
from hftrain.parallel.readers import default_readers, default_workers
from hftrain.planning import run_length
from hftrain.planning.run_length import RunLength
from hftrain.recipe.objectives import OBJECTIVES, Objective
from hftrain.recipe.parts import (
    BatchPart,
    CheckpointPart,
    FinetunePart,
    ModelPart,
    PlanPart,
    PublishPart,
    RunLengthPart,
    SpeedPart,
    TokenizerPart,
    TrainerPart,
)
from hftrain.recipe.report_to import check_installed
from hftrain.recipe.schema import DataSection, Recipe
from hftrain.recipe.sections import FaultsSection, MonitorSection, ProfileSection
from hftrain.training.arguments import argument_values


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: each field is one component's part."""

    as_run: Recipe  # the recipe with the batch the fit chose: what the Run record hands back to the caller
    launch: LaunchEnv
    output_dir: Path
    shape: ModelShape  # the model measured on the meta device: parameters, FLOPs per token, config
    data: DataPlan
    dims: ParallelDims
    fit_note: str | None  # parallelism.fit_memory's choice, or the warning that the recipe's batch will not fit
    length: RunLength
    resume: ResumeSetting
    arguments: dict[str, Any]  # TrainingArguments values before the speed levers (training/arguments.py)
    push_to_hub: bool
    objective: Objective
    model: ModelPart
    finetune: FinetunePart
    tokenizer: TokenizerPart
    speed: SpeedPart
    checkpoints: CheckpointPart
    publish: PublishPart
    trainer: TrainerPart
    data_section: DataSection
    monitor: MonitorSection
    faults: FaultsSection
    profile: ProfileSection
    max_memory: dict[Any, Any] | None  # parallelism.max_memory (device_map)
    recorded: dict[str, Any]  # what a continuing run recorded at its start (its speed levers are kept)


def recorded_start(recipe: Recipe) -> dict[str, Any]:
    """What a continuing run in the recipe's output_dir recorded at its start (empty for a new run)."""
    resume = ResumeSetting.of(recipe.training_kwargs().get("resume_from_checkpoint"))
    return CheckpointManager(RunLayout(Path(recipe.training.output_dir)), CheckpointPart.of(recipe), resume).recorded_start()


def resolve(recipe: Recipe, launch: LaunchEnv, recorded: dict[str, Any]) -> RunSpec:
    """The run's spec; `recorded` keeps a continuing run's global batch, readers and speed levers."""
    check_installed(recipe.training.report_to)  # a tracker's library, before anything is measured or written
    check_starting_weights(FinetunePart.of(recipe))
    shape = measure_model(ModelPart.of(recipe))  # on the meta device: nothing is loaded
    strategy = parallel.resolve_strategy(recipe.parallelism.strategy, launch)
    # the memory fit on paper, before the data's shards are listed: a certain out-of-memory is refused first (fit.py)
    batch, fit_note = fit_batch(recipe, launch, strategy, shape, recorded.get("global_batch"))
    data = plan_data(recipe.data, recipe.training.seed)
    recipe = batch.applied_to(recipe)  # from here on, the recipe as this run runs it
    kwargs = recipe.training_kwargs()
    workers = loader_workers(kwargs, launch, recipe.data, recorded, data.reader_limit)
    if "dataloader_num_workers" not in kwargs and workers:
        kwargs["dataloader_num_workers"] = workers  # the arguments say what the dims and the loader use
    dims = parallel.resolve(launch, strategy, batch, recipe.data, recorded, data.reader_limit, workers)
    length = run_length.resolve(RunLengthPart.of(recipe), dims.global_batch, data.manifest_tokens)
    spec = RunSpec(
        as_run=recipe,
        launch=launch,
        output_dir=Path(recipe.training.output_dir),
        shape=shape,
        data=data,
        dims=dims,
        fit_note=fit_note,
        length=length,
        resume=ResumeSetting.of(kwargs.get("resume_from_checkpoint")),
        arguments=argument_values(kwargs, dims, length, launch.device),
        push_to_hub=bool(kwargs.get("push_to_hub", False)),
        objective=OBJECTIVES[recipe.finetune.objective],
        model=ModelPart.of(recipe),
        finetune=FinetunePart.of(recipe),
        tokenizer=TokenizerPart.of(recipe),
        speed=SpeedPart.of(recipe),
        checkpoints=CheckpointPart.of(recipe),
        publish=PublishPart.of(recipe),
        trainer=TrainerPart.of(recipe),
        data_section=recipe.data,
        monitor=recipe.monitor,
        faults=recipe.faults,
        profile=recipe.profile,
        max_memory=recipe.parallelism.max_memory,
        recorded=recorded,
    )
    CheckpointManager(RunLayout(spec.output_dir), spec.checkpoints, spec.resume).check_same_run()  # before the probe and the model
    return spec


def loader_workers(kwargs: dict[str, Any], launch: LaunchEnv, data: DataSection, recorded: dict[str, Any], reader_limit: int | None) -> int:
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
    run out of memory is an HftrainError here, before any tokenizer, model or data is loaded (parallelism.memory_check)."""
    batch = BatchPart.of(recipe)
    if strategy is Strategy.DEVICE_MAP:
        return batch, None
    from hftrain.planning.estimates import plan
    from hftrain.planning.fit import fit_this_run

    part = PlanPart.of(recipe)
    total = parallel.global_batch(batch, launch.processes, recorded, launch.elastic_most_nodes, launch.local_processes)
    name = "single" if strategy is Strategy.SINGLE else strategy.value
    fitted, note = fit_this_run(part, plan(part, shape), launch.processes, launch.local_processes, name, launch.device, total)
    if note and not batch.fit_memory and launch.memory_warned:
        note = None  # `hftrain train --accelerate-config` said it once before starting the processes
    return fitted, note


def plan(recipe: Recipe, shape: ModelShape | None = None) -> dict[str, Any]:
    """`hftrain.plan(recipe)`: the recipe's model, FLOPs and memory on paper (planning/estimates.py), from its plan part."""
    from hftrain.planning.estimates import plan as estimate

    return estimate(PlanPart.of(recipe), shape)
