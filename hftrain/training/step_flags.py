"""What a training step must agree on across processes (a non-finite loss or gradient norm, a preemption signal),
kept on the device, so that the host never waits for the GPU in the middle of a run.

Every host read of a device value (``.item()``, ``bool(t)``, ``float(t)``: torch's ``_local_scalar_dense``) waits
for every kernel queued before it, and the GPU then idles until the host queues the next work. The plain Trainer
reads where it logs. Here:

* each optimizer step's flags are one small tensor on the training device, set by kernels (no copy from the host);
  with several processes one all-reduce (MAX) agrees them, queued like any kernel (NCCL: no host wait);
* what must act at once acts on the device: a non-finite step is skipped by the fused optimizer itself (its
  ``found_inf``, as torch's GradScaler uses it), so every process skips the same step;
* the host reads the flags of the steps since its last read in one copy, where the Trainer reads anyway (a log
  line, a checkpoint, an evaluation, the end) and at most ``READ_EVERY`` steps apart;
* a signal needs every process to stop at the same step: the agreed flags of step N are copied to host memory
  without waiting and read at the end of step N+1, when they are long computed (a wait for that copy does not
  drain the queue: step N+1's kernels are still in it).

Worst-case delays, in optimizer steps: with several processes a signal acts at most 2 steps after the one in which
it arrived (it joins the next step's flags, read one step later; one process acts at that step's end, as before); a non-finite step is skipped at that very step (fused optimizers; others read at once, as
before), and a stop or the ``max_skipped_steps`` limit acts at the next read: at most ``READ_EVERY - 1`` steps
later, never after a checkpoint is written.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

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

    def of_step(self, step: int, nonfinite: torch.Tensor | None = None, norm: Any = None, keep: bool = True) -> torch.Tensor:
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
