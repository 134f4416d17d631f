"""Where the training time goes: waiting for data, forward, backward, optimizer; and peak memory.

The trainer wraps each phase of a step in ``StepTimer.phase``; the totals since the previous log line become
``data_wait_frac``, ``forward_frac``, ``backward_frac`` and ``optimizer_frac`` (the rest is logging, callbacks
and the scheduler). Evaluation and checkpoint saves are not step time: they are left out of the interval.

Host clocks measure a phase exactly on CPUs, where every operation runs synchronously. On a GPU the host
runs ahead of the device, and timing each phase would need a synchronisation per phase, which is exactly the
cost a fast loop avoids; so there only the data wait (a host-side quantity) is reported, and the ``profile``
recipe section gives the device-side split. Each phase is also a ``record_function`` range, so it shows up
by name (``hftrain.forward`` ...) in profiler traces.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("data_wait", "forward", "backward", "optimizer")
EXCLUDED = "excluded"  # evaluation and checkpoint saves inside a logging interval


class StepTimer:
    def __init__(self, split: bool):
        self.split = split  # time forward/backward/optimizer too (CPU only, see the module docstring)
        self.interval: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.wall_total = 0.0
        self.intervals = 0
        self._mark = time.perf_counter()
        self._stack: list[list] = []

    @contextmanager
    def phase(self, name: str, label: str | None = None) -> Iterator[None]:
        """Time a phase; a phase inside another is subtracted from the outer one's own time."""
        inside_excluded = any(entry[0] == EXCLUDED for entry in self._stack)
        timed = not inside_excluded and (name in (EXCLUDED, "data_wait") or self.split)
        with torch.profiler.record_function(f"hftrain.{label or name}"):
            if not timed:
                yield
                return
            entry = [name, time.perf_counter(), 0.0]  # name, start, time of nested phases
            self._stack.append(entry)
            try:
                yield
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - entry[1]
                self.interval[name] += elapsed - entry[2]
                if self._stack:
                    self._stack[-1][2] += elapsed

    def restart(self) -> None:
        """Training (re)starts: what came before (model loading, resume) is not step time."""
        self.interval.clear()
        self._mark = time.perf_counter()

    def take(self) -> tuple[float, dict[str, float]]:
        """Step seconds since the previous call and each phase's share of them; starts a new interval."""
        now = time.perf_counter()
        wall = max(now - self._mark - self.interval.pop(EXCLUDED, 0.0), 1e-9)
        self._mark = now
        fractions = {}
        for name in PHASES if self.split else ("data_wait",):
            seconds = self.interval.get(name, 0.0)
            self.total[name] += seconds
            fractions[f"{name}_frac"] = round(min(seconds / wall, 1.0), 4)
        self.wall_total += wall
        self.intervals += 1
        self.interval.clear()
        return wall, fractions

    def run_fraction(self, name: str) -> float | None:
        """The phase's share of all step time so far (None before the first interval)."""
        return self.total[name] / self.wall_total if self.wall_total else None


def process_age_s() -> float:
    """Seconds since this process started (interpreter and imports included), from the OS."""
    import psutil  # a dependency of accelerate

    return max(time.time() - psutil.Process().create_time(), 0.0)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory: allocated device memory on CUDA, the resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def input_bound_advice(fraction: float, threshold: float, workers: int) -> str:
    """What to say when this share of the step time went to waiting for data."""
    return (
        f"input-bound: {100 * fraction:.0f}% of the step time was spent waiting for data "
        f"(monitor.input_bound_threshold={threshold}). Raise training.dataloader_num_workers (now {workers}), "
        "pre-tokenize the data (`hftrain data prepare`, then data.train: [{pretokenized: DIR}]), "
        "or move the data closer to the machine (local disk, or an object store in the same region)."
    )
