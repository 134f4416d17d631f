"""A step's faults, acted on by every process at the same step: a non-finite loss or gradient norm (the guard,
``NonFiniteGuard``: stop, keeping the last good checkpoint, or skip the step, as ``faults.on_nonfinite`` says) and a
preemption signal (``PreemptionCallback``: SIGTERM / SIGUSR1 save a checkpoint at a step boundary, then stop). Both
travel in the step's flags (``StepFlags``), kept on the device, so that the host never waits for the GPU in the
middle of a run.

Every host read of a device value (``.item()``, ``bool(t)``, ``float(t)``: torch's ``_local_scalar_dense``) waits
for every kernel queued before it, and the GPU then idles until the host queues the next work. The plain Trainer
reads where it logs. Here:

* each optimizer step's flags are one small tensor on the training device, set by kernels (no copy from the host);
  with several processes one all-reduce (MAX) agrees them, queued like any kernel (NCCL: no host wait);
* what must act at once acts on the device: a non-finite step is skipped by the fused optimizer itself (its
  ``found_inf``, as torch's GradScaler uses it), so every process skips the same step; parameters and optimizer
  state stay exactly as they were. Any other optimizer needs the answer before its step: there the flag is read at
  once (one wait per step), and a skip drops the gradients (set to None): torch's optimizers leave a parameter
  without a gradient, and its state, exactly as they were;
* the host reads the flags of the steps since its last read in one copy, where the Trainer reads anyway (a log
  line, a checkpoint, an evaluation, the end) and at most ``READ_EVERY`` steps apart, before any checkpoint is
  written, and then stops, or records the skipped steps;
* a signal needs every process to stop at the same step: the agreed flags of step N are copied to host memory
  without waiting and read at the end of step N+1, when they are long computed (a wait for that copy does not
  drain the queue: step N+1's kernels are still in it).

hftrain's Trainer reports what the guard needs (``saw_loss``, ``saw_grad_norm``: the norm the Trainer computed
anyway, already global). Attached to any other Trainer (a subclass hftrain did not write, such as TRL's), nothing
feeds it, so at the public ``on_pre_optimizer_step`` event it checks the gradients itself.

Worst-case delays, in optimizer steps: with several processes a signal acts at most 2 steps after the one in which
it arrived (it joins the next step's flags, read one step later; one process acts at that step's end); a
non-finite step is skipped at that very step (fused optimizers; others read at once), and a stop or the
``max_skipped_steps`` limit acts at the next read: at most ``READ_EVERY - 1`` steps later, never after a checkpoint
is written.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from hftrain.errors import HftrainError
from hftrain.recipe.sections import FaultsSection

READ_EVERY = 50  # optimizer steps between host reads of the non-finite flags, at most (a log line reads sooner)
NONFINITE, SIGNAL, NORM = 0, 1, 2  # a step's flags, and its gradient norm (NaN when unknown) for the message


class StepFlags:
    def __init__(self, device: torch.device | str, world_size: int = 1):
        self.device, self.world_size = torch.device(device), world_size
        self.signal = False  # this process received a signal (host; the handler sets it)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, agreed flags) not yet read by the host
        self._staged: tuple[int, torch.Tensor, Any] | None = None  # (step, host copy, its copy's event)
        self._last_read = 0

    @property
    def agrees(self) -> bool:
        import torch.distributed as dist

        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def of_step(
        self, step: int, nonfinite: torch.Tensor | None = None, norm: Any = None, keep: bool = True
    ) -> torch.Tensor:
        """Optimizer step `step`'s flags, agreed by every process (on the device; nothing is read back here).
        `nonfinite`: this process saw a non-finite value in the step (a boolean tensor on the device); `norm`: the
        step's gradient norm (a tensor or a float), for the message; `keep`: pending until the host reads them."""
        flags = torch.zeros(3, device=self.device)  # kernels set every value: no copy from the host
        flags[NORM] = math.nan
        if nonfinite is not None:
            flags[NONFINITE] = nonfinite.to(device=self.device)
        if isinstance(norm, torch.Tensor):  # a plain tensor (the guard reads FSDP2's DTensor norm whole)
            flags[NORM] = norm.detach().reshape(()).to(device=self.device, dtype=flags.dtype)
        elif norm is not None:
            flags[NORM] = float(norm)
        if self.signal:
            flags[SIGNAL] = 1.0
        if self.agrees:
            import torch.distributed as dist

            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if keep:
            self.pending.append((step, flags))
        return flags

    def due(self, step: int, trainer_reads: bool) -> bool:
        """Whether the host reads the pending flags at the end of `step` (the same answer on every process)."""
        return bool(self.pending) and (trainer_reads or step - self._last_read >= READ_EVERY)

    def read(self, step: int) -> list[tuple[int, list[float]]]:
        """The flags of every step since the last read, in one copy (it waits for those steps' kernels)."""
        self._last_read = step
        if not self.pending:
            return []
        values = host(torch.stack([flags for _, flags in self.pending]))
        read = [(s, row) for (s, _), row in zip(self.pending, values.tolist())]
        self.pending.clear()
        return read

    def stage_signal(self, step: int) -> None:
        """Start copying step `step`'s agreed flags to the host, without waiting (read at the next step's end)."""
        if self.pending and self.pending[-1][0] == step:
            flags = self.pending[-1][1]  # the guard's flags of this step carry the signal too
        else:  # no guard's flags for this step (read already, or a Trainer that feeds none): the signal alone
            flags = self.of_step(step, keep=False)
        if flags.device.type == "cuda":
            copy = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            copy.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            copy, event = flags, None  # computed already: CPU kernels run as they are called
        self._staged = (step, copy, event)

    def staged_signal(self) -> bool:
        """Whether any process had received a signal by the staged step (its copy waited for, not the queue)."""
        if self._staged is None:
            return False
        _, copy, event = self._staged
        if event is not None:
            event.synchronize()
        return bool(host(copy)[SIGNAL])


def host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values on the host: one device-to-host copy for a device tensor, none for a CPU one."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.detach().numpy()


class NonFiniteGuard(TrainerCallback):
    def __init__(
        self, policy: FaultsSection, latest_checkpoint: Callable[[], Path | None], flags: StepFlags | None = None
    ):
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

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, optimizer: Any = None, model: Any = None, **kwargs: Any
    ) -> None:
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
        print(
            "hftrain: non-finite loss or gradient norm at step "
            f"{step}: step skipped ({len(self.skipped_steps)} so far)",
            flush=True,
        )


def on_device_skip(optimizer: Any) -> Any:
    """The torch optimizer under `optimizer` (accelerate wraps it) when it can skip a step on the device: a fused
    one (it takes ``found_inf``, as GradScaler uses it) outside fp16's own scaler; else None."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's AcceleratedOptimizer (itself an Optimizer) holds torch's
        inner = inner.optimizer
    scaled = getattr(optimizer, "scaler", None) is not None  # fp16: the GradScaler sets found_inf itself
    fused = (
        isinstance(inner, torch.optim.Optimizer)
        and inner.defaults.get("fused")
        and getattr(inner, "_step_supports_amp_scaling", False)
    )
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


class PreemptionCallback(TrainerCallback):
    """SIGTERM / SIGUSR1 (SLURM, spot instances): save a checkpoint at a step boundary, then stop.

    One process acts at the end of the step in which the signal arrived. Several processes agree on it through
    the steps' flags on the device (StepFlags: one all-reduce, no host wait) and act at most two steps
    later, every rank at the same step even if only one was signalled.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, flags: StepFlags | None = None) -> None:
        self.received: str | None = None
        self.step: int | None = None
        self.flags = flags
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if self.flags is not None:
            self.flags.signal = True  # into the next step's flags

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.flags is None:
            self.flags = StepFlags(args.device, args.world_size)

    def _agreed(self, step: int) -> bool:
        flags = self.flags
        if flags is None or not flags.agrees:
            return self.received is not None
        agreed = flags.staged_signal()  # the previous step's agreement, read without draining the queue
        flags.signal = self.received is not None
        flags.stage_signal(step)
        if agreed and self.received is None:
            self.received = "a signal to another rank"
        return agreed

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._agreed(state.global_step):
            self.step = state.global_step
            control.should_save = True
            control.should_training_stop = True

    def restore(self) -> None:
        for sig in self.SIGNALS:
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, signal.SIG_DFL)
