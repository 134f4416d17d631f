"""Run `hftrain train` as a user would and watch it from outside: peak RSS summed over its process tree (the
main process and its DataLoader workers) and the CPU seconds its processes spent until the first logged step (the
work done, not the wall time: a test worker beside it on the same 2 cores doubles the one and not the other)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hftrain.checkpoint.layout import RunLayout


@dataclass
class Measured:
    returncode: int | None  # None: stopped by the watcher (memory or time limit)
    peak_rss_bytes: int
    first_step_s: float | None  # CPU seconds (user + system) of the process tree up to the first logged step
    stderr: str


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tree_cpu_s(proc: psutil.Process) -> float:
    """User + system seconds of a process, its live children and the children it has reaped."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + (t.children_user + t.children_system if p is proc else 0.0)
        except psutil.Error:
            pass
    return total


def train_and_watch(
    recipe: Path,
    output_dir: Path,
    *overrides: str,
    cwd: Path | None = None,
    env: dict | None = None,
    limit_bytes: int = 6 << 30,
    limit_s: float = 600,
) -> Measured:
    """Train, sampling the process tree's RSS every 50 ms; stop it past `limit_bytes` or `limit_s`."""
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe), f"training.output_dir={output_dir}", *overrides]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    watched, peak, first, cpu = psutil.Process(proc.pid), 0, None, 0.0
    metrics = RunLayout(output_dir).metrics
    stopped = False
    while proc.poll() is None:
        peak = max(peak, tree_rss(watched))
        cpu = max(cpu, tree_cpu_s(watched))
        if first is None and metrics.exists() and '"loss"' in metrics.read_text():
            first = cpu
        if peak > limit_bytes or time.perf_counter() - started > limit_s:
            proc.kill()
            stopped = True
            break
        time.sleep(0.05)
    _, err = proc.communicate()
    if first is None and metrics.exists() and '"loss"' in metrics.read_text():
        first = cpu  # finished between two samples: the last reading
    return Measured(None if stopped else proc.returncode, peak, first, err)
