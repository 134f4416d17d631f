"""The recipe's training section -> transformers.TrainingArguments, plus what hftrain keeps for itself.

hftrain handles four TrainingArguments keys itself: ``resume_from_checkpoint`` (the CheckpointManager finds
the checkpoint), ``push_to_hub`` (the Trainer's own push would upload output_dir's root; hub.py pushes the
final model), ``save_total_limit`` (rotation happens after a checkpoint is complete, checkpoint.py), and the
data skip on resume (hftrain restores its data position instead of replaying batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainingArguments

from . import cpu_compat, parallel, run_length, speed
from .errors import HftrainError
from .data.readers import ReaderLayout, decide_readers, decide_window
from .model import ModelShape
from .parallel import Launch
from .recipe_schema import Recipe
from .run_length import RunLength
from .speed import SpeedPlan


@dataclass
class TrainingSettings:
    args: TrainingArguments
    resume: bool | str | None  # training.resume_from_checkpoint as the recipe gives it
    push_to_hub: bool
    speed: SpeedPlan  # the speed defaults chosen, with their reasons and measurements (speed.py)
    length: RunLength  # max_steps and where it came from (run_length.py)
    readers: ReaderLayout  # the run's logical data readers over this launch (data/readers.py)

    @property
    def global_batch(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size

    def start_record(self) -> dict[str, Any]:
        """What a run records at its start and keeps when it continues (CheckpointManager.recorded_start)."""
        levers = {key: value for key in speed.LEVER_KEYS if (value := getattr(self.args, key)) is not None}
        return {"speed": levers, "global_batch": self.global_batch, "readers": self.readers.readers, "shuffle_window": self.readers.window}


def training_arguments(recipe: Recipe, launch: Launch, shape: ModelShape, recorded: dict[str, Any] | None = None,
                       manifest_tokens: int | None = None, reader_limit: int | None = None) -> TrainingSettings:  # fmt: skip
    """TrainingArguments for this launch. `recorded`: what a continuing run recorded at its start (speed levers,
    global batch, readers, shuffle window); `manifest_tokens`: the prepared data's size (epochs need it); `reader_limit`: for
    the default reader count."""
    recorded = recorded or {}
    kwargs = parallel.batch_kwargs(recipe, recipe.training_kwargs(), launch.world_size, recorded.get("global_batch"))
    resume = kwargs.pop("resume_from_checkpoint", None)
    push = bool(kwargs.pop("push_to_hub", False))
    kwargs.pop("save_total_limit", None)  # the CheckpointManager rotates, once a new checkpoint is complete
    length = run_length.resolve(recipe, kwargs, launch.world_size, manifest_tokens)
    kwargs["max_steps"] = length.max_steps
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    kwargs.update(ignore_data_skip=True, remove_unused_columns=False)  # batches hold only model inputs
    kwargs = cpu_compat.training_kwargs(kwargs, launch.rehearsal)
    device = training_device(kwargs, launch)
    memory = cpu_compat.keep_freed_memory(device)  # before the speed probe: it times steps as training runs them
    plan = speed_defaults(recipe, kwargs, launch, shape, recorded.get("speed"), device)
    if memory:
        plan.reasons.append(memory)
    try:
        args = TrainingArguments(**kwargs)
    except (ValueError, TypeError) as err:
        raise HftrainError(f"training: {err}") from None
    workers = max(args.dataloader_num_workers, 1)
    count = decide_readers(recipe.data.readers, recorded.get("readers"), reader_limit, launch.world_size, workers)
    window = decide_window(recipe.data.shuffle_window, recorded.get("shuffle_window"), count, recipe.data.seq_len)
    return TrainingSettings(args, resume, push, plan, length, ReaderLayout(count, launch.world_size, workers, window))


def training_device(kwargs: dict[str, Any], launch: Launch) -> torch.device:
    """The device this process trains on."""
    return torch.device("cpu" if kwargs.get("use_cpu") or not torch.cuda.is_available() else f"cuda:{launch.local_rank}")


def speed_defaults(recipe: Recipe, kwargs: dict[str, Any], launch: Launch, shape: ModelShape,
                   recorded: dict[str, bool] | None, device: torch.device) -> SpeedPlan:  # fmt: skip
    """bf16 / fp16 / tf32 / torch_compile where the recipe leaves them unset: as recorded at the run's start
    (a resumed run), else decided by measurement on this device (speed.py), the same in every process."""
    kwargs.setdefault("ddp_find_unused_parameters", False)
    unset = [key for key in speed.LEVER_KEYS if key not in kwargs]
    if not unset:
        return speed.SpeedPlan()
    if recorded is not None:  # a continuing run: what it started with, never a new measurement
        kept = {key: value for key, value in recorded.items() if key in unset}
        kwargs.update(kept)
        reasons = [f"kept from the run's start: {', '.join(f'{k}={v}' for k, v in kept.items())}"] if kept else []
        return speed.SpeedPlan(values=kept, reasons=reasons)
    decided = parallel.agree("speed", lambda: speed.decide_here(recipe, kwargs, launch.strategy, shape, device).to_json())
    plan = speed.SpeedPlan.from_json(decided)
    kwargs.update(plan.values)
    return plan
