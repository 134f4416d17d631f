"""What every training log line gets beyond the loss: tokens seen, tokens/s (total and per device), MFU,
tokens per dollar, the share of step time per phase (step_timing.py) and peak memory; and the input-bound
verdict, live (once) and for the whole run.

The first step after a (re)start is start-up, not steady state: it waits for the first window of data, for
DataLoader workers to spawn and for compilation. It is reported on its own as the time to the first step
(from the process's start), and kept out of tokens/s, MFU and the input-bound verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hftrain.training.step_timing import PHASES, StepTimer, input_bound_advice, peak_memory_gb, process_age_s


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
    def __init__(self, options: MetricsOptions, device: torch.device, is_main: bool):
        self.options, self.device, self.is_main = options, device, is_main
        self.timer = StepTimer(split=device.type == "cpu")
        self._last_step: int | None = None
        self._warned_input_bound = False
        self._starting = False
        self.time_to_first_step_s: float | None = None
        self.counted_tokens: Any = None  # () -> tokens of all processes so far, where steps differ in tokens (DPO pairs)
        self._last_tokens = 0

    def start(self, step: int) -> None:
        """Training (re)starts at `step`: what came before (model loading, resume) is not step time."""
        self._last_step = step
        self._starting = True
        self._last_tokens = self._tokens()
        self.timer.restart()

    def _tokens(self) -> int:
        return int(self.counted_tokens()) if self.counted_tokens is not None else 0

    def step_done(self, step: int) -> None:
        """After each optimizer step: the first one after a (re)start ends start-up; the clocks start there."""
        if not self._starting:
            return
        self._starting = False
        self.time_to_first_step_s = round(process_age_s(), 2)
        self._last_step = step
        self._last_tokens = self._tokens()
        self.timer.restart()

    def for_log_line(self, step: int) -> dict[str, float]:
        """Throughput, MFU, cost, where the step time went and peak memory, since the previous log line."""
        o = self.options
        counted = self.counted_tokens is not None
        out: dict[str, float] = {} if counted else {"tokens_seen": float(step * o.tokens_per_step)}
        seconds, fractions = self.timer.take()
        tokens = self._tokens()
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
            print(f"hftrain: warning: {input_bound_advice(fraction, threshold, self.options.dataloader_workers)}", flush=True)

    def run_split(self) -> dict[str, Any]:
        """The run-wide share of step time per phase, peak memory and the input-bound verdict (results.json)."""
        out: dict[str, Any] = {f"{name}_frac": round(f, 4) for name in PHASES if (f := self.timer.run_fraction(name)) is not None}
        out["peak_mem_gb"] = round(peak_memory_gb(self.device), 3)
        out["time_to_first_step_s"] = self.time_to_first_step_s
        wait = out.get("data_wait_frac")
        out["input_bound"] = wait is not None and wait > self.options.input_bound_threshold and self.timer.intervals >= 2
        return out
