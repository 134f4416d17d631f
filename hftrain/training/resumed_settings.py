"""What a resumed run does with each key its recipe changed since the checkpoint: applied from the resume step and
said, or refused before anything loads. Nothing that changed is ignored without a word.

TrainingArguments are made from the recipe at every start, so most keys simply apply. Saved state would override
four kinds of them silently, and is put right here:

* the optimizer's param groups (optimizer.pt): learning rate, weight decay, Adam's betas and epsilon, any optimizer's
  own settings. The Trainer loads the checkpoint's over the groups it built from the recipe; ``ResumedSettings``
  puts the recipe's back at train begin and prints each change with the step it applies from.
* the schedule (scheduler.pt): its base learning rates are the checkpoint's, its function the recipe's (max_steps,
  warmup, type, lr_scheduler_kwargs, or the lr_schedule section's), and the first resumed step ran at the rate the
  checkpoint's schedule left in the optimizer (a finished cosine continued for more steps took its first step at 0).
  The base rates become the recipe's and the first resumed step gets the recipe's schedule at that step, said when
  it differs.
* the logging, eval and save intervals (trainer_state.json): the recipe's are put back at train begin and said.
* what the data order is drawn from, and the optimizer's kind: refused with both values (``check_unchanged``).

``ON_RESUME`` is the table of the keys a user may change (docs/operations.md holds the same, checked by its test);
a key it does not name is read from the recipe at every start (clipping, the kept checkpoints, tracking...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hftrain.checkpoint.layout import RECIPE_FILE
from hftrain.errors import HftrainError


@dataclass(frozen=True)
class OnResume:
    applied: bool  # False: refused when it differs from the checkpoint's
    how: str


_GROUPS = "applied: from the resume step, the optimizer's groups get the recipe's value over the checkpoint's"
_SCHEDULE = "applied: the recipe's schedule from the resume step, its rate at that step said when it differs"
_EVERY_START = "applied: read from the recipe at every start (no saved state holds it)"
_INTERVAL = "applied: the recipe's over trainer_state.json's from the resume step, said when it differs"
_LEVER = "applied: when set; unset, the value chosen at the run's start is kept (speed/defaults.py)"
ON_RESUME: dict[str, OnResume] = {
    "training.learning_rate": OnResume(True, _GROUPS + " and the schedule's base rate"),
    "training.weight_decay": OnResume(True, _GROUPS),
    "training.adam_beta1": OnResume(True, _GROUPS),
    "training.adam_beta2": OnResume(True, _GROUPS),
    "training.adam_epsilon": OnResume(True, _GROUPS),
    "training.max_steps": OnResume(True, _SCHEDULE),
    "training.num_train_epochs": OnResume(True, _SCHEDULE),
    "training.warmup_steps": OnResume(True, _SCHEDULE),
    "training.lr_scheduler_type": OnResume(True, _SCHEDULE),
    "training.lr_scheduler_kwargs": OnResume(True, _SCHEDULE),
    "lr_schedule.type": OnResume(True, _SCHEDULE),
    "lr_schedule.decay_steps": OnResume(True, _SCHEDULE),
    "lr_schedule.warmup_fraction": OnResume(True, _SCHEDULE),
    "lr_schedule.min_lr_rate": OnResume(True, _SCHEDULE),
    "training.max_grad_norm": OnResume(True, _EVERY_START),
    "training.gradient_checkpointing": OnResume(True, _EVERY_START),
    "training.logging_steps": OnResume(True, _INTERVAL),
    "training.save_steps": OnResume(True, _INTERVAL),
    "training.eval_steps": OnResume(True, _INTERVAL),
    "training.save_total_limit": OnResume(True, _EVERY_START),
    "training.per_device_train_batch_size": OnResume(
        True, "applied: while the global batch stays the same; a changed global batch is refused (parallel/batch.py)"
    ),
    "training.gradient_accumulation_steps": OnResume(
        True, "applied: while the global batch stays the same; a changed global batch is refused (parallel/batch.py)"
    ),
    "training.bf16": OnResume(True, _LEVER),
    "training.fp16": OnResume(True, _LEVER),
    "training.tf32": OnResume(True, _LEVER),
    "training.torch_compile": OnResume(True, _LEVER),
    "speed.loss": OnResume(True, _EVERY_START),
    "speed.fp8": OnResume(True, _EVERY_START),
    "training.optim": OnResume(False, "the checkpoint's optimizer state (Adam's moments) belongs to its optimizer"),
    "training.optim_args": OnResume(False, "the checkpoint's optimizer state was made with these settings"),
    "training.seed": OnResume(
        False, "the data order (shuffles, mixture draws) is drawn from it: another seed, another order"
    ),
}
# the optimizer's own names for the settings its groups hold, as the recipe names them
GROUP_KEYS = {
    "lr": "training.learning_rate",
    "weight_decay": "training.weight_decay",
    "betas": "training.adam_beta1 / adam_beta2",
    "eps": "training.adam_epsilon",
}
# lr: the schedule's; initial_lr: its base; step: a count some optimizers keep per group (DeepSpeed's Adam), state
_NOT_SETTINGS = {"params", "param_names", "lr", "initial_lr", "step"}


def check_unchanged(training: dict[str, Any], checkpoint: Path | None) -> None:
    """Refuse a resume whose recipe changed a key the table refuses, naming the key, both values and what to do.
    `training`: the recipe's training section as run (its defaults filled); the checkpoint's is read from its
    saved recipe (a checkpoint without one, from an older hftrain, is not checked)."""
    if checkpoint is None or not (checkpoint / RECIPE_FILE).is_file():
        return
    from hftrain.recipe.transformers_table import training_fields
    from hftrain.recipe.yaml_io import load_yaml

    try:
        saved = (load_yaml((checkpoint / RECIPE_FILE).read_text(encoding="utf-8")) or {}).get("training") or {}
    except Exception:  # noqa: BLE001 - an unreadable saved recipe is the integrity check's to name, not this one's
        return
    defaults = {f.name: f.default for f in training_fields()}
    for key, rule in ON_RESUME.items():
        section, name = key.split(".", 1)
        if rule.applied or section != "training":
            continue
        given, recorded = training.get(name, defaults.get(name)), saved.get(name, defaults.get(name))
        if given != recorded:
            raise HftrainError(
                f"{key}: {given!r} given, but {checkpoint.name} was trained with {recorded!r} "
                f"({checkpoint / RECIPE_FILE}): {rule.how}. Set it back to {recorded!r} to continue this run, "
                "or start a new one with training.resume_from_checkpoint=false (the earlier run is moved aside) "
                "or another training.output_dir."
            )


class ResumedSettings(TrainerCallback):
    """The recipe's optimizer settings and schedule over the checkpoint's, at train begin of a resumed run.

    `remember` is called with the optimizer and schedule the Trainer built from the recipe, before any checkpoint
    loads (HftrainTrainer.create_scheduler); at train begin, after the load, each group gets those settings back."""

    def __init__(self) -> None:
        self.fresh: list[dict[str, Any]] = []

    def remember(self, optimizer: Any) -> None:
        self.fresh = [
            {k: v for k, v in group.items() if k not in {"params", "param_names"}} for group in _groups(optimizer)
        ]

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            return
        step, lines = state.global_step, _recipe_intervals(args, state)
        optimizer, schedule = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        groups = _groups(optimizer)
        if not self.fresh or len(groups) != len(self.fresh):  # another grouping: nothing to compare one to one
            groups, schedule = [], None
        for key in sorted({k for fresh in self.fresh for k in fresh} - _NOT_SETTINGS):
            loaded = [group.get(key) for group in groups]
            if any(isinstance(value, torch.Tensor) for value in loaded):
                continue  # state the optimizer keeps in its groups, not a setting
            wanted = [fresh.get(key, old) for fresh, old in zip(self.fresh, loaded)]
            if loaded != wanted:
                for group, value in zip(groups, wanted):
                    group[key] = value
                lines.append(
                    f"{GROUP_KEYS.get(key, f'the optimizer setting {key!r}')} {_one(loaded)} -> {_one(wanted)}"
                )
        schedule = getattr(schedule, "scheduler", schedule)  # accelerate's wrapper holds the schedule
        if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):  # transformers' schedules but reduce_lr_on_plateau
            bases = [fresh.get("initial_lr", fresh.get("lr")) for fresh in self.fresh]
            if list(schedule.base_lrs) != bases:
                lines.append(f"{GROUP_KEYS['lr']} {_one(schedule.base_lrs)} -> {_one(bases)}")
            before = [group["lr"] for group in groups]
            now = [base * rate(schedule.last_epoch) for base, rate in zip(bases, schedule.lr_lambdas)]
            for group, base, value in zip(groups, bases, now):
                group["initial_lr"], group["lr"] = base, value
            # the schedule's own record: its base rates, and the rate it reports (the Trainer logs it) for this step
            schedule.load_state_dict({**schedule.state_dict(), "base_lrs": bases, "_last_lr": now})
            if now != before:
                lines.append(
                    f"learning rate at step {step + 1}: {_one(now)} on the recipe's schedule (the checkpoint left "
                    f"{_one(before)})"
                )
        if lines and state.is_world_process_zero:
            print(
                f"hftrain: resumed at step {step} with the recipe's settings from step {step + 1}: " + "; ".join(lines)
            )


def _recipe_intervals(args: Any, state: Any) -> list[str]:
    """The recipe's logging, eval and save intervals over those of trainer_state.json, which the Trainer loads with
    the state (transformers only warns: a resume saved at the checkpoint's interval, not the recipe's)."""
    lines = []
    for kind in ("logging", "eval", "save"):
        given = getattr(args, f"{kind}_steps", None)
        if given is None:
            continue
        if given < 1:  # a fraction of the run, as TrainerState.compute_steps takes it
            given = math.ceil(state.max_steps * given)
        loaded = getattr(state, f"{kind}_steps", None)
        if loaded != given:
            setattr(state, f"{kind}_steps", given)
            lines.append(f"training.{kind}_steps {loaded} -> {given}")
    return lines


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    return list(getattr(optimizer, "param_groups", []))


def _one(values: list[Any]) -> str:
    """A group-wise value as one number when the groups agree (weight decay: the no-decay group's 0 apart)."""
    distinct = list(dict.fromkeys(map(repr, values)))
    return distinct[0] if len(distinct) == 1 else "[" + ", ".join(map(repr, values)) + "]"
