"""The non-finite guard: a NaN/inf loss or gradient norm stops the run (keeping the last good checkpoint) or
skips that optimizer step, as ``faults.on_nonfinite`` says.

The trainer reports what it sees (``saw_loss``, ``saw_grad_norm``); skipping happens through the Trainer's
public ``on_pre_optimizer_step`` event: the gradients are dropped (set to None), and torch's optimizers leave
a parameter without a gradient, and its state, exactly as they were.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import TrainerCallback

from hftrain.errors import HftrainError
from hftrain.recipe.schema import FaultsSection


class NonFiniteGuard(TrainerCallback):
    def __init__(self, policy: FaultsSection, latest_checkpoint: Callable[[], Path | None]):
        self.policy, self.latest_checkpoint = policy, latest_checkpoint
        self.skipped_steps: list[int] = []
        self._seen = False  # a non-finite loss in this optimizer step's micro-batches
        self._skip = False

    def saw_loss(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss).all():
            self._seen = True

    def saw_grad_norm(self, grad_norm: Any, step: int) -> None:
        """Called once per optimizer step, before it: decide whether it runs."""
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            self._seen = True
        if self._seen:
            self._on_nonfinite(float(grad_norm) if grad_norm is not None else float("nan"), step)

    def _on_nonfinite(self, grad_norm: float, step: int) -> None:
        latest = self.latest_checkpoint()
        kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
        if self.policy.on_nonfinite == "stop" or len(self.skipped_steps) >= self.policy.max_skipped_steps:
            why = ("faults.on_nonfinite=stop" if self.policy.on_nonfinite == "stop"
                   else f"{len(self.skipped_steps)} steps already skipped (faults.max_skipped_steps)")  # fmt: skip
            raise HftrainError(
                f"training: non-finite loss or gradient norm ({grad_norm}) at step {step}; stopped ({why}). {kept}. "
                "Lower training.learning_rate, check the data, or set faults.on_nonfinite=skip."
            )
        self.skipped_steps.append(step)
        self._skip = True
        print(f"hftrain: non-finite loss or gradient norm at step {step}: step skipped ({len(self.skipped_steps)} so far)", flush=True)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self._skip and optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # parameters and optimizer state stay as they were
        self._skip = self._seen = False
