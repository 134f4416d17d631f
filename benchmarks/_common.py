"""Shared pieces of the training benchmarks (throughput.py, ddp_scaling.py): a step clock callback, the
steady-state summary of its times, child-process plumbing and small statistics helpers."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
LOSS_TAIL = 3  # final training loss = mean of the last LOSS_TAIL logged losses


class StepClock(TrainerCallback):
    """time.perf_counter() at every step event the Trainer calls (transformers 5.x).

    One optimizer step, in the order the Trainer runs it: fetch the step's micro-batches (between the previous
    on_step_end and on_step_begin, together with the previous step's logging), forward + backward of each
    micro-batch and the gradient clipping (on_step_begin -> on_pre_optimizer_step; under DDP the gradient
    all-reduce runs inside backward), optimizer.step() (-> on_optimizer_step), scheduler step and zero_grad
    (-> on_step_end)."""

    EVENTS = ("step_begin", "pre_optimizer_step", "optimizer_step", "step_end")

    def __init__(self) -> None:
        self.train_begin = 0.0
        self.times: dict[str, list[float]] = {e: [] for e in self.EVENTS}
        self.cpu: list[float] = []  # process CPU time at each on_step_end: cpu/wall shows how contended a run was
        self.waited: list[
            float
        ] = []  # seconds spent after each on_step_end waiting for another side's turn (_turns.py)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.train_begin = time.perf_counter()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times["step_begin"].append(time.perf_counter())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times["pre_optimizer_step"].append(time.perf_counter())

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times["optimizer_step"].append(time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times["step_end"].append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.waited.append(0.0)

    def to_json(self) -> dict[str, Any]:
        return {"train_begin": self.train_begin, **self.times, "cpu": self.cpu, "waited": self.waited}


def warmup_steps(steps: int) -> int:
    """Steps left out of the steady state: the first 20%, at least 2 (the first step holds allocation and, with
    torch.compile, compilation; steps here are seconds long, so later ones are already steady)."""
    return min(max(2, math.ceil(0.2 * steps)), max(1, steps // 2))


def step_durations(clock: dict[str, Any]) -> list[float]:
    """Wall time of each optimizer step, on_step_end to on_step_end: everything the loop does (data, compute,
    logging) counts, the wait for this side's next turn (after a step's on_step_end) does not. The first step
    is measured from on_train_begin."""
    return [b - a for a, b in zip(_starts(clock), clock["step_end"])]


def _starts(clock: dict[str, Any]) -> list[float]:
    """When each step began: the previous on_step_end, plus any wait for the turn after it."""
    ends, waited = clock["step_end"], clock.get("waited") or [0.0] * len(clock["step_end"])
    return [clock["train_begin"], *(end + wait for end, wait in zip(ends[:-1], waited))]


def steady_state(clock: dict[str, Any], tokens_per_step: int) -> dict[str, float]:
    """tokens/s = median over the steps after warm-up of tokens_per_step / step time; warm-up seconds apart."""
    durations = step_durations(clock)
    skip = warmup_steps(len(durations))
    timed = durations[skip:]
    ends, cpu = clock["step_end"], clock["cpu"]
    waited = sum((clock.get("waited") or [0.0] * len(ends))[skip - 1 : -1])
    return {
        "tokens_per_s": statistics.median(tokens_per_step / d for d in timed),
        "step_s": statistics.median(timed),
        # the pace a whole run keeps: periodic work (data windows, logging) included
        "mean_step_s": statistics.mean(timed),
        "warmup_s": sum(durations[:skip]),
        "timed_steps": len(timed),
        # CPU seconds per wall second over the timed steps: about the thread count when the run had the cores
        "cpu_util": (cpu[-1] - cpu[skip - 1]) / (ends[-1] - ends[skip - 1] - waited),
    }


def phase_medians(clock: dict[str, Any]) -> dict[str, float]:
    """Median seconds per steady-state step in each phase (see StepClock)."""
    t = clock
    n = len(t["step_end"])
    skip = warmup_steps(n)
    prev_end = _starts(t)
    phases = {
        "data_wait": [t["step_begin"][i] - prev_end[i] for i in range(n)],
        "forward_backward": [t["pre_optimizer_step"][i] - t["step_begin"][i] for i in range(n)],
        "optimizer": [t["optimizer_step"][i] - t["pre_optimizer_step"][i] for i in range(n)],
        "after_step": [t["step_end"][i] - t["optimizer_step"][i] for i in range(n)],
    }
    return {name: statistics.median(values[skip:]) for name, values in phases.items()}


def final_loss(log_history: Sequence[dict[str, Any]]) -> float:
    losses = [e["loss"] for e in log_history if "loss" in e]
    return statistics.mean(losses[-LOSS_TAIL:])


def run_child(cmd: list[str], log: Path, result: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one measurement in a fresh process (output to `log`); return the JSON it wrote to `result`."""
    with log.open("w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if code != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        sys.exit(f"benchmark child failed (exit {code}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    return json.loads(result.read_text())


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    Path(path).write_text(json.dumps(data), encoding="utf-8")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


class PeakFlops:
    """Best fp32 and bf16 matmul FLOP/s seen on the CPU or GPU (hftrain.speed.hardware.measure_peak_flops, hftrain's own
    MFU denominator). Measured again before every run and the best kept: on a shared machine one measurement may
    catch a busy moment, and MFU against it would overshoot."""

    def __init__(self, device: str = "cpu") -> None:
        self.best = {"fp32": 0.0, "bf16": 0.0}
        self.device = device

    def measure(self, seconds: float = 0.5) -> dict[str, float]:
        import torch

        from hftrain.speed.hardware import measure_peak_flops

        device = torch.device(self.device)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            self.best[name] = max(self.best[name], measure_peak_flops(device, dtype, seconds))
        return self.best
