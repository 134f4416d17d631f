"""What a step measures, and what every training log line gets beyond the loss: tokens seen, tokens/s (total and
per device), MFU, tokens per dollar, the share of step time per phase and peak memory; the input-bound verdict,
live (once) and for the whole run; and metrics.jsonl, every log line appended as JSON.

The clock: the trainer wraps each phase of a step in ``StepTimer.phase``; the totals since the previous log line
become ``data_wait_frac``, ``forward_frac``, ``backward_frac`` and ``optimizer_frac`` (the rest is logging,
callbacks and the scheduler). Evaluation and checkpoint saves are not step time: they are left out of the interval.
Host clocks measure a phase exactly on CPUs, where every operation runs synchronously. On a GPU the host runs ahead
of the device, and timing each phase would need a synchronisation per phase, which is exactly the cost a fast loop
avoids; so there only the data wait (a host-side quantity) is reported, and the ``profile`` recipe section gives
the device-side split. Each phase is also a ``record_function`` range, so it shows up by name (``hftrain.forward``
...) in profiler traces.

The first step after a (re)start is start-up, not steady state: it waits for the first window of data, for
DataLoader workers to spawn and for compilation. It is reported on its own as the time to the first step (from the
process's start), kept out of tokens/s, MFU and the input-bound verdict, and ends progress.py's start-up watchdog.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hftrain import progress
from hftrain.checkpoint.layout import RunLayout

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


@dataclass(frozen=True)
class MetricsOptions:
    """The numbers the metrics are computed from, fixed for a run."""

    tokens_per_step: int  # global: micro-batch x accumulation x processes x seq_len
    world_size: int
    flops_per_token: float
    peak_flops: float  # per device: the MFU denominator
    price_per_hour: float | None
    input_bound_threshold: float
    dataloader_workers: int


class StepMetrics:
    def __init__(self, options: MetricsOptions, device: torch.device, is_main: bool, counts_tokens: bool = False):
        self.options, self.device, self.is_main = options, device, is_main
        # steps differ in tokens (DPO pairs): tokens/s counts the positions the loader's batches held, all processes
        self.counts_tokens = counts_tokens
        self.timer = StepTimer(split=device.type == "cpu")
        self._last_step: int | None = None
        self._warned_input_bound = False
        self._starting = False
        self.time_to_first_step_s: float | None = None
        self._last_tokens = 0

    def start(self, step: int, loader: Any = None) -> None:
        """Training (re)starts at `step`: what came before (model loading, resume) is not step time. `loader`:
        the training loader (ResumableLoader), whose batches' positions count where steps differ in tokens."""
        self._last_step = step
        self._starting = True
        self._last_tokens = self._tokens(loader)
        self.timer.restart()

    def _tokens(self, loader: Any) -> int:
        if not self.counts_tokens or loader is None:
            return 0
        return int(loader.tokens["block"]) * self.options.world_size

    def step_done(self, step: int, loader: Any = None) -> None:
        """After each optimizer step: the first one after a (re)start ends start-up (and the watchdog's lines); the
        clocks start there."""
        if not self._starting:
            return
        self._starting = False
        progress.stop()  # start-up is over: the progress bar and the logs speak from here
        self.time_to_first_step_s = round(process_age_s(), 2)
        self._last_step = step
        self._last_tokens = self._tokens(loader)
        self.timer.restart()

    def for_log_line(self, step: int, loader: Any = None) -> dict[str, float]:
        """Throughput, MFU, cost, where the step time went and peak memory, since the previous log line."""
        o = self.options
        counted = self.counts_tokens
        out: dict[str, float] = {} if counted else {"tokens_seen": float(step * o.tokens_per_step)}
        seconds, fractions = self.timer.take()
        tokens = self._tokens(loader)
        if self._last_step is not None and step > self._last_step:
            rate = (tokens - self._last_tokens if counted else (step - self._last_step) * o.tokens_per_step) / seconds
            out["tokens_per_s"] = round(rate, 1)
            out["tokens_per_s_per_device"] = round(rate / o.world_size, 1)
            out["mfu"] = round(rate * o.flops_per_token / (o.peak_flops * o.world_size), 4)
            if o.price_per_hour:
                out["tokens_per_usd"] = round(rate * 3600 / o.price_per_hour, 1)
            out.update(fractions)
            self._warn_if_input_bound()
        out["peak_mem_gb"] = round(peak_memory_gb(self.device), 3)
        self._last_step, self._last_tokens = step, tokens
        return out

    def _warn_if_input_bound(self) -> None:
        """Once, when the run so far (two log intervals at least: one slow read is no verdict) mostly waited."""
        threshold, fraction = self.options.input_bound_threshold, self.timer.run_fraction("data_wait")
        if self.timer.intervals < 2 or fraction is None or fraction <= threshold or self._warned_input_bound:
            return
        if self.is_main:
            self._warned_input_bound = True
            print(
                f"hftrain: warning: {input_bound_advice(fraction, threshold, self.options.dataloader_workers)}",
                flush=True,
            )

    def run_split(self) -> dict[str, Any]:
        """The run-wide share of step time per phase, peak memory and the input-bound verdict (results.json)."""
        out: dict[str, Any] = {
            f"{name}_frac": round(f, 4) for name in PHASES if (f := self.timer.run_fraction(name)) is not None
        }
        out["peak_mem_gb"] = round(peak_memory_gb(self.device), 3)
        out["time_to_first_step_s"] = self.time_to_first_step_s
        wait = out.get("data_wait_frac")
        out["input_bound"] = (
            wait is not None and wait > self.options.input_bound_threshold and self.timer.intervals >= 2
        )
        return out


class ThroughputClockCallback(TrainerCallback):
    """Starts the tokens/s clock after the first step of a (re)start, so start-up time is not counted; and times
    each optimizer step (between the Trainer's pre- and post-optimizer-step events) as the "optimizer" phase."""

    def __init__(self, metrics: StepMetrics):
        self.metrics = metrics
        self._optimizer_phase = ExitStack()

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        self.metrics.start(state.global_step, train_dataloader)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._optimizer_phase.enter_context(self.metrics.timer.phase("optimizer"))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._optimizer_phase.close()

    def on_step_end(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        self.metrics.step_done(state.global_step, train_dataloader)


class MetricsFileCallback(TrainerCallback):
    """Appends every log line (training and evaluation) to output_dir/metrics.jsonl, one JSON object per line."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
        path = RunLayout(Path(args.output_dir)).metrics
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
