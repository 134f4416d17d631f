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

from . import cpu_compat, parallel, speed
from .errors import HftrainError
from .model import ModelShape
from .parallel import Launch
from .recipe_schema import Recipe


@dataclass
class TrainingSettings:
    args: TrainingArguments
    resume: bool | str | None  # training.resume_from_checkpoint as the recipe gives it
    push_to_hub: bool
    keep_checkpoints: int | None  # training.save_total_limit
    speed_choices: list[str]  # one line per speed default chosen (speed.py)


def training_arguments(recipe: Recipe, launch: Launch, shape: ModelShape) -> TrainingSettings:
    kwargs = parallel.batch_kwargs(recipe, recipe.training_kwargs(), launch.world_size)
    resume = kwargs.pop("resume_from_checkpoint", None)
    push = bool(kwargs.pop("push_to_hub", False))
    keep = kwargs.pop("save_total_limit", None)
    if not kwargs.get("max_steps") or kwargs["max_steps"] <= 0:
        raise HftrainError(
            "training.max_steps: required. hftrain streams its data, so a run is measured in optimizer steps, "
            "not epochs; set e.g. training.max_steps=1000."
        )
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    kwargs.update(ignore_data_skip=True, remove_unused_columns=False)  # batches hold only model inputs
    kwargs = cpu_compat.training_kwargs(kwargs, launch.rehearsal)
    choices = speed_defaults(recipe, kwargs, launch, shape)
    try:
        args = TrainingArguments(**kwargs)
    except (ValueError, TypeError) as err:
        raise HftrainError(f"training: {err}") from None
    return TrainingSettings(args, resume, push, keep, choices)


def speed_defaults(recipe: Recipe, kwargs: dict[str, Any], launch: Launch, shape: ModelShape) -> list[str]:
    """bf16 / torch_compile where the recipe leaves them unset (speed.py), from the model's measured size."""
    device = torch.device("cpu" if kwargs.get("use_cpu") or not torch.cuda.is_available() else "cuda")
    tokens = kwargs["per_device_train_batch_size"] * kwargs.get("gradient_accumulation_steps", 1) * recipe.data.seq_len
    size = {"matmul_params": shape.matmul_params, "hidden_size": shape.config.hidden_size}
    return speed.apply_defaults(recipe, kwargs, launch.strategy, size, tokens * shape.flops_per_token, device)
