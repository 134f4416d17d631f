"""The non-finite guard: a NaN/inf loss or gradient norm stops the run (keeping the last good checkpoint) or
skips that optimizer step, as ``faults.on_nonfinite`` says, on every process at the same step.

hftrain's Trainer reports what it sees (``saw_loss``, ``saw_grad_norm``: the norm the Trainer computed anyway).
Attached to any other Trainer (a subclass hftrain did not write, such as TRL's), nothing feeds it, so at the public
``on_pre_optimizer_step`` event it checks the gradients itself.

None of this reads a device value back on the host at each step (training/step_flags.py says why and gives the
worst-case delays): the step's flag stays on the device, agreed by every process (the gradient norm already is:
the Trainer computes the global norm). A fused optimizer (AdamW's default on CUDA and CPU) skips a flagged step on
the device (``found_inf``): parameters and optimizer state stay exactly as they were. The host reads the flags at
the Trainer's next log line, checkpoint or evaluation (or READ_EVERY steps), before any checkpoint is written, and
then stops, or records the skipped steps. Any other optimizer needs the answer before its step: there the flag is
read at once (one wait per step), and a skip drops the gradients (set to None): torch's optimizers leave a
parameter without a gradient, and its state, exactly as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hftrain.errors import HftrainError
from hftrain.recipe.sections import FaultsSection
from hftrain.training.step_flags import NONFINITE, NORM, StepFlags, host


class NonFiniteGuard(TrainerCallback):
    def __init__(self, policy: FaultsSection, latest_checkpoint: Callable[[], Path | None], flags: StepFlags | None = None):
        self.policy, self.latest_checkpoint, self.flags = policy, latest_checkpoint, flags
        self.skipped_steps: list[int] = []
        self._loss_bad: torch.Tensor | None = None  # a non-finite loss in this optimizer step's micro-batches (device)
        self._grad_norm: Any = None
        self._fed = False  # saw_grad_norm ran for this optimizer step (hftrain's Trainer)
        self._skip_now = False  # read at once (an optimizer that cannot skip on the device): drop the gradients

    def saw_loss(self, loss: torch.Tensor) -> None:
        bad = torch.logical_not(torch.isfinite(loss.detach()).all())
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def saw_grad_norm(self, grad_norm: Any, step: int) -> None:
        """Called once per optimizer step, before it, with the norm the Trainer computed."""
        self._fed, self._grad_norm = True, grad_norm

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.flags is None:
            self.flags = StepFlags(args.device, args.world_size)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None, **kwargs: Any) -> None:
        step = state.global_step + 1
        norm = local(self._grad_norm.detach()) if isinstance(self._grad_norm, torch.Tensor) else self._grad_norm
        bad = self._step_flag(model, norm)
        self._loss_bad, self._grad_norm, self._fed = None, None, False
        agreed = self.flags.of_step(step, bad, norm)[NONFINITE]
        inner = on_device_skip(optimizer)
        if inner is not None:
            inner.found_inf = agreed  # the fused step skips itself where the flag is 1, on every process alike
            return
        values = host(self.flags.pending.pop()[1])  # read at once (acted on here, not at the next read): this
        if values[NONFINITE]:  # optimizer steps whatever its gradients are
            self._on_nonfinite(step, float(values[NORM]))
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)  # parameters and optimizer state stay as they were

    def _step_flag(self, model: Any, norm: Any) -> torch.Tensor | None:
        """This process's verdict on the step, on the device: the losses and the norm the Trainer reported (`norm`,
        a plain tensor or a float), else the gradients themselves (a Trainer that does not feed the guard)."""
        if not self._fed:
            return None if model is None else gradients_nonfinite(model)
        bad = self._loss_bad
        if isinstance(norm, torch.Tensor):
            norm_bad = torch.logical_not(torch.isfinite(norm).all())
            bad = norm_bad if bad is None else bad | norm_bad.to(bad.device)
        elif norm is not None and not math.isfinite(norm):  # a float already (DeepSpeed's norm)
            bad = torch.ones((), dtype=torch.bool) if bad is None else torch.ones_like(bad)
        return bad

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Where the Trainer reads anyway (or READ_EVERY steps): act on the steps flagged since the last read, before
        this step's checkpoint is written."""
        reads = control.should_log or control.should_save or control.should_evaluate or control.should_training_stop
        if self.flags is None or not self.flags.due(state.global_step, reads or state.global_step >= state.max_steps):
            return
        for step, values in self.flags.read(state.global_step):
            if values[NONFINITE]:
                self._on_nonfinite(step, values[NORM])

    def _on_nonfinite(self, step: int, grad_norm: float) -> None:
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
        print(f"hftrain: non-finite loss or gradient norm at step {step}: step skipped ({len(self.skipped_steps)} so far)", flush=True)


def on_device_skip(optimizer: Any) -> Any:
    """The torch optimizer under `optimizer` (accelerate wraps it) when it can skip a step on the device: a fused
    one (it takes ``found_inf``, as GradScaler uses it) outside fp16's own scaler; else None."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's AcceleratedOptimizer (itself an Optimizer) holds torch's
        inner = inner.optimizer
    scaled = getattr(optimizer, "scaler", None) is not None  # fp16: the GradScaler sets found_inf itself
    fused = isinstance(inner, torch.optim.Optimizer) and inner.defaults.get("fused") and getattr(inner, "_step_supports_amp_scaling", False)
    return inner if fused and not scaled else None


def gradients_nonfinite(model: Any) -> torch.Tensor | None:
    """Whether any gradient of this process is non-finite, as a tensor on the device (nothing read back)."""
    checks = [torch.logical_not(torch.isfinite(shard(p.grad)).all()) for p in model.parameters() if p.grad is not None]
    return torch.stack(checks).any() if checks else None


def local(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `value`'s whole value (FSDP2 hands a DTensor norm; the guard's flags are plain tensors)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def shard(grad: torch.Tensor) -> torch.Tensor:
    """This process's part of a gradient (FSDP2: a DTensor's local shard; the flags' all-reduce covers the rest)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad
