"""The global batch: sequences per optimizer step, from parallelism.global_batch_size, or as a continuing run
recorded at its start, or micro-batch x accumulation on every process (of all MAX nodes of an elastic launch); and
the gradient accumulation that makes it on this launch's processes, refusing what does not divide. Results do not
depend on the device count only while the global batch stays the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hftrain.errors import HftrainError

if TYPE_CHECKING:
    from hftrain.parallel.dims import LaunchEnv
    from hftrain.recipe.schema import Recipe


@dataclass(frozen=True)
class BatchPart:
    """The batch keys, from which parallel/dims.py alone derives the global batch: parallelism.global_batch_size and
    the training section's micro-batch, evaluation batch, accumulation and gradient checkpointing. The memory fit
    (planning/fit.py) answers with another BatchPart, never a new recipe (training/resolve.py's
    with_batch gives the recipe as the run runs it)."""

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


def global_batch(
    batch: BatchPart, processes: int, recorded: int | None = None, elastic_nodes: int | None = None, per_node: int = 1
) -> int:
    """Sequences per optimizer step, derived here alone: parallelism.global_batch_size, else the one `recorded` at a
    continuing run's start (so that a run continued on another process count keeps its sequences per step), else
    micro-batch x accumulation on every process: of `processes`, or, for an elastic launch, of all its MAX
    `elastic_nodes` x `per_node` (so that it does not depend on how many nodes the first start happened to have).
    A global_batch_size other than the recorded one is refused: each step would mean other tokens (tokens_seen
    jumps)."""
    per_process = batch.micro_batch * int(batch.accumulation or 1)
    if batch.global_batch_size and recorded and int(batch.global_batch_size) != int(recorded):
        raise HftrainError(
            f"parallelism.global_batch_size: {batch.global_batch_size} sequences per step, but this run started with "
            f"{recorded} (recorded in its hftrain_run.json): each step would train on another number of tokens "
            f"(tokens_seen would jump). Remove parallelism.global_batch_size to keep {recorded}, or "
            "set training.output_dir to a new directory to start a new run."
        )
    if batch.global_batch_size or recorded:
        return int(batch.global_batch_size or recorded)  # type: ignore[arg-type]
    return per_process * (elastic_nodes * per_node if elastic_nodes else processes)


def derive_accumulation(batch: BatchPart, launch: LaunchEnv, recorded: int | None = None, announce: bool = True) -> int:
    """Gradient accumulation from the global batch (``global_batch``), refusing what does not divide and naming the
    process counts that would."""
    processes, micro, given = launch.processes, batch.micro_batch, batch.accumulation
    total = global_batch(batch, processes, recorded, launch.elastic_most_nodes, launch.local_processes)
    per_step = micro * processes
    if total % per_step:
        fits = [p for p in range(1, total // micro + 1) if total % (micro * p) == 0]
        what = (
            f"{total} sequences"
            if batch.global_batch_size
            else f"this run started with {total} sequences per step (recorded in its hftrain_run.json), which"
            if recorded
            else (
                f"{total} sequences (micro-batch x accumulation on each "
                f"process of all {launch.elastic_most_nodes} nodes)"
            )
        )
        raise HftrainError(
            f"parallelism.global_batch_size: {what} cannot be split into micro-batches of {micro} "
            f"(training.per_device_train_batch_size) on {processes} process(es); it must be a multiple of {per_step}. "
            f"With that micro-batch, {', '.join(map(str, fits)) or 'no'} process count(s) work; or change the "
            "micro-batch. (Results do not depend on the device count only while the global batch stays the same.)"
        )
    accumulation = total // per_step
    if given not in (None, accumulation) and batch.accumulation_given:
        if batch.global_batch_size:
            raise HftrainError(
                f"training.gradient_accumulation_steps: {given} contradicts parallelism.global_batch_size={total} "
                f"(which needs {accumulation} with {micro} x {processes}); remove one of the two."
            )
        if announce:
            kept = (
                "recorded at its start"
                if recorded
                else f"each process of all {launch.elastic_most_nodes} nodes of this elastic launch"
            )
            print(
                f"hftrain: keeping this run's global batch of {total} sequences ({kept}): "
                f"gradient_accumulation_steps {given} -> {accumulation} on {processes} process(es)",
                flush=True,
            )
    return accumulation


def check_elastic_batch(batch: BatchPart, least: int, most: int, per_node: int) -> None:
    """Before an elastic launch: the global batch must split over every node count from MIN to MAX."""
    total = global_batch(batch, 1, None, most, per_node)
    micro = batch.micro_batch
    bad = [n for n in range(least, most + 1) if total % (micro * per_node * n)]
    if bad:
        step = micro * per_node
        raise HftrainError(
            f"parallelism.global_batch_size: {total} sequences per step cannot be split over "
            f"{', '.join(map(str, bad))} "
            f"node(s) x {per_node} process(es) with micro-batches of {micro}, and this elastic "
            f"launch (--nnodes {least}:{most}) may run on any node count from {least} to {most}. Set "
            f"parallelism.global_batch_size to a multiple of {step} x each of those counts (e.g. "
            f"{step * _lcm(least, most)}), or narrow MIN:MAX."
        )


def _lcm(least: int, most: int) -> int:
    import math

    return math.lcm(*range(least, most + 1))
