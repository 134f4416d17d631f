"""The non-finite guard: a NaN/inf loss or gradient norm stops the run (keeping the last good checkpoint) or
skips that optimizer step, as ``faults.on_nonfinite`` says.

hftrain's Trainer reports what it sees (``saw_loss``, ``saw_grad_norm``: the norm the Trainer computed anyway).
Attached to any other Trainer (a subclass hftrain did not write, such as TRL's), nothing feeds it, so at the public
``on_pre_optimizer_step`` event it checks the gradients itself: non-finite anywhere in this process's gradients,
agreed over all processes (one all-reduce of a flag, so every rank stops or skips at the same step, also when FSDP
or ZeRO-3 hold gradient shards). Skipping also happens at that event: the gradients are dropped (set to None), and
torch's optimizers leave a parameter without a gradient, and its state, exactly as they were.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from hftrain.errors import HftrainError
from hftrain.recipe.sections import FaultsSection


class NonFiniteGuard(TrainerCallback):
    def __init__(self, policy: FaultsSection, latest_checkpoint: Callable[[], Path | None]):
        self.policy, self.latest_checkpoint = policy, latest_checkpoint
        self.skipped_steps: list[int] = []
        self._seen = False  # a non-finite loss in this optimizer step's micro-batches
        self._skip = False
        self._fed = False  # saw_grad_norm ran for this optimizer step (hftrain's Trainer)

    def saw_loss(self, loss: torch.Tensor) -> None:
        if not torch.isfinite(loss).all():
            self._seen = True

    def saw_grad_norm(self, grad_norm: Any, step: int) -> None:
        """Called once per optimizer step, before it: decide whether it runs."""
        self._fed = True
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            self._seen = True
        if self._seen:
            self._on_nonfinite(float(grad_norm) if grad_norm is not None else float("nan"), step)

    def _on_nonfinite(self, grad_norm: float, step: int) -> None:
        latest = self.latest_checkpoint()
        kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
        if self.policy.on_nonfinite == "stop" or len(self.skipped_steps) >= self.policy.max_skipped_steps:
            why = (
                "faults.on_nonfinite=stop"
                if self.policy.on_nonfinite == "stop"
                else f"{len(self.skipped_steps)} steps already skipped (faults.max_skipped_steps)"
            )
            raise HftrainError(
                f"training: non-finite loss or gradient norm ({grad_norm}) at step {step}; stopped ({why}). {kept}. "
                "Lower training.learning_rate, check the data, or set faults.on_nonfinite=skip."
            )
        self.skipped_steps.append(step)
        self._skip = True
        print(f"hftrain: non-finite loss or gradient norm at step {step}: step skipped ({len(self.skipped_steps)} so far)", flush=True)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None, **kwargs: Any) -> None:
        if not self._fed and model is not None and not gradients_finite(model, args):
            self._on_nonfinite(float("nan"), state.global_step + 1)
        if self._skip and optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # parameters and optimizer state stay as they were
        self._skip = self._seen = self._fed = False


def gradients_finite(model: Any, args: Any) -> bool:
    """Every gradient of every process finite (the check of a guard that no Trainer override feeds)."""
    import torch.distributed as dist

    bad = any(p.grad is not None and not torch.isfinite(p.grad).all() for p in model.parameters())
    if args.world_size > 1 and dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1.0 if bad else 0.0], device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    return not bad
