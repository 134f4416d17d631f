"""The recipe's training section -> transformers.TrainingArguments, plus what hftrain keeps for itself.

hftrain handles four TrainingArguments keys itself: ``resume_from_checkpoint`` (the CheckpointManager finds
the checkpoint), ``push_to_hub`` (the Trainer's own push would upload output_dir's root; hub.py pushes the
final model), ``save_total_limit`` (rotation happens after a checkpoint is complete, checkpoint.py), and the
data skip on resume (hftrain restores its data position instead of replaying batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments

from hftrain import _compat
from hftrain.parallel import rehearsal
from hftrain.parallel import launcher_store
from hftrain.parallel.dims import ParallelDims
from hftrain.plan import run_length
from hftrain.speed import defaults as speed
from hftrain.checkpoint import node_disks
from hftrain.checkpoint.manager import ResumeSetting
from hftrain.errors import HftrainError
from hftrain.model.build import ModelShape
from hftrain.recipe.schema import Recipe
from hftrain.plan.run_length import RunLength
from hftrain.speed.defaults import SpeedPlan
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.training import objectives


@dataclass
class TrainingSettings:
    args: TrainingArguments
    resume: ResumeSetting  # training.resume_from_checkpoint, read once
    push_to_hub: bool
    speed: SpeedPlan  # the speed defaults chosen, with their reasons and measurements (speed.py)
    length: RunLength  # max_steps and where it came from (run_length.py)
    dims: ParallelDims  # the run's parallel dims (parallel/dims.py): strategy, batch, readers

    def start_record(self) -> dict[str, Any]:
        """What a run records at its start and keeps when it continues (CheckpointManager.recorded_start)."""
        levers = {key: value for key in speed.LEVER_KEYS if (value := getattr(self.args, key)) is not None}
        readers = self.dims.readers
        return {"speed": levers, "global_batch": self.dims.global_batch, "readers": readers.readers, "shuffle_window": readers.window}


def training_arguments(
    recipe: Recipe, dims: ParallelDims, shape: ModelShape, recorded: dict[str, Any] | None = None, manifest_tokens: int | None = None
) -> TrainingSettings:
    """TrainingArguments for this run's dims. `recorded`: what a continuing run recorded at its start (speed
    levers); `manifest_tokens`: the prepared data's size (epochs need it)."""
    recorded = recorded or {}
    kwargs = recipe.training_kwargs()
    kwargs["gradient_accumulation_steps"] = dims.accumulation
    resume = ResumeSetting.of(kwargs.pop("resume_from_checkpoint", None))
    push = bool(kwargs.pop("push_to_hub", False))
    kwargs.pop("save_total_limit", None)  # the CheckpointManager rotates, once a new checkpoint is complete
    length = run_length.resolve(recipe, kwargs, dims.global_batch, manifest_tokens)
    kwargs["max_steps"] = length.max_steps
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    kwargs.update(ignore_data_skip=True, remove_unused_columns=False)  # batches hold only model inputs
    kwargs = rehearsal.training_kwargs(kwargs, dims.rehearsal)
    node_disks.storage_settings(kwargs, Path(recipe.training.output_dir), dims)  # several nodes: a shared disk or each its own
    device = training_device(kwargs, dims)
    memory = _compat.keep_freed_memory(device)  # before the speed probe: it times steps as training runs them
    plan = speed_defaults(recipe, kwargs, dims, shape, recorded.get("speed"), device)
    if memory:
        plan.reasons.append(memory)
    try:
        args = objectives.training_arguments(recipe.finetune, kwargs, recipe.data.seq_len)  # DPO: TRL's DPOConfig
    except (ValueError, TypeError) as err:
        raise HftrainError(f"{OBJECTIVES[recipe.finetune.objective].sections}: {err}") from None
    return TrainingSettings(args, resume, push, plan, length, dims)


def training_device(kwargs: dict[str, Any], dims: ParallelDims) -> torch.device:
    """The device this process trains on."""
    return torch.device("cpu" if kwargs.get("use_cpu") or not torch.cuda.is_available() else f"cuda:{dims.local_rank}")


def speed_defaults(
    recipe: Recipe, kwargs: dict[str, Any], dims: ParallelDims, shape: ModelShape, recorded: dict[str, bool] | None, device: torch.device
) -> SpeedPlan:
    """bf16 / fp16 / tf32 / torch_compile where the recipe leaves them unset: as recorded at the run's start
    (a resumed run), else decided by measurement on this device (speed.py), the same in every process."""
    kwargs.setdefault("ddp_find_unused_parameters", False)
    unset = [key for key in speed.LEVER_KEYS if key not in kwargs]
    if not speed.undecided(kwargs):  # e.g. bf16 and torch_compile set, tf32 not: nothing a measurement would decide
        return speed.SpeedPlan()
    if recorded is not None:  # a continuing run: what it started with, never a new measurement
        kept = {key: value for key, value in recorded.items() if key in unset}
        kwargs.update(kept)
        reasons = [f"kept from the run's start: {', '.join(f'{k}={v}' for k, v in kept.items())}"] if kept else []
        return speed.SpeedPlan(values=kept, reasons=reasons)
    decide = lambda: speed.decide_here(recipe, kwargs, dims.strategy, shape, device).to_json()  # noqa: E731
    decided = launcher_store.agree("speed", decide, dims.rank, dims.processes)
    plan = speed.SpeedPlan.from_json(decided)
    kwargs.update(plan.values)
    return plan
