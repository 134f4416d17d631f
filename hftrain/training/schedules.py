"""Learning-rate schedules transformers does not have, for the recipe's ``lr_schedule`` section.

gpt_neox_annealing is gpt-neox v1.0's ``AnnealingLR`` with ``lr_decay_style: cosine`` (megatron/learning_rates.py at
tag v1.0 of EleutherAI/gpt-neox), the schedule Pythia trained with. Transcribed from its ``get_lr``::

    num_iters_ = min(self.num_iters, self.end_iter - self.warmup_iter)
    if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
        return float(self.start_lr) * num_iters_ / self.warmup_iter
    num_iters_ = num_iters_ - self.warmup_iter
    lr = self.start_lr / 2.0 * (math.cos(math.pi * num_iters_ / self.end_iter) + 1)
    return max(lr, self.min_lr)

with ``end_iter = max(1, lr_decay_iters or train_iters)`` and ``warmup_iter = warmup * end_iter`` (a float:
megatron/training.py, get_learning_rate_scheduler). The warmup is not floored (step 0 runs at 0), the cosine's divisor
is end_iter (not end_iter - warmup_iter), and past end_iter - warmup_iter the step is held there. Its ``num_iters``
counts applied optimizer steps: built with ``last_iter=0`` (the first step runs at get_lr(0)) and stepped by
DeepSpeed after each optimizer step that was not skipped for an fp16 overflow; a LambdaLR stepped by the Trainer after
each optimizer step it takes is the same count.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from hftrain.recipe.sections import LrScheduleSection


def gpt_neox_annealing_lr(step: int, peak: float, warmup_steps: float, decay_steps: int, min_lr: float) -> float:
    """gpt-neox v1.0's AnnealingLR.get_lr (cosine) at `step` applied optimizer steps (0: the first step's rate)."""
    held = min(step, decay_steps - warmup_steps)
    if warmup_steps > 0 and step <= warmup_steps:
        return float(peak) * held / warmup_steps
    lr = peak / 2.0 * (math.cos(math.pi * (held - warmup_steps) / decay_steps) + 1)
    return max(lr, min_lr)


def _annealing_factor(step: int, first_step: int, warmup_steps: float, decay_steps: int, min_lr_rate: float) -> float:
    # a module-level function behind functools.partial (as transformers' schedules): LambdaLR saves and loads the
    # __dict__ of a callable object, which would bring a checkpoint's settings back over the recipe's on resume
    return gpt_neox_annealing_lr(first_step + step, 1.0, warmup_steps, decay_steps, min_lr_rate)


def gpt_neox_annealing(
    optimizer: Any, section: LrScheduleSection, max_steps: int, first_step: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The recipe's gpt_neox_annealing schedule over `optimizer`, whose groups' rates are the peak. The run's k-th
    optimizer step (k from 0) gets the formula at first_step + k: a run that continues Pythia at its step N passes N.
    decay_steps defaults to the run's last step, first_step + max_steps."""
    decay_steps = max(1, section.decay_steps or first_step + max_steps)
    warmup_steps = section.warmup_fraction * decay_steps  # gpt-neox: warmup * num_iters, unrounded
    factor = partial(
        _annealing_factor,
        first_step=first_step,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        min_lr_rate=section.min_lr_rate,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
