"""The recipe's ``profile: {start_step, steps}``: torch.profiler over those training steps.

Writes, per process, into ``OUTPUT_DIR/profile/``:

* ``rankN.<time>.pt.trace.json``: a Chrome trace; open it in Perfetto (ui.perfetto.dev) or point TensorBoard
  (with the torch-tb-profiler plugin) at the directory;
* ``summary-rankN.txt``: where the profiled step time went (the ``hftrain.*`` phase ranges that the trainer
  marks: data wait, forward, backward, optimizer) and the operations that took the most time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from hftrain.checkpoint.layout import RunLayout
from hftrain.recipe.sections import ProfileSection

TOP_OPERATIONS = 15


class ProfilerCallback(TrainerCallback):
    def __init__(self, section: ProfileSection, output_dir: Path, process_index: int):
        self.section, self.rank = section, process_index
        self.out = RunLayout(output_dir).profile
        self.profiler: Any = None
        self.started_at = 0.0
        self.summary_path: Path | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is None and self.summary_path is None and state.global_step + 1 == self.section.start_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if args.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=self.section.record_shapes,
                profile_memory=self.section.profile_memory,
                with_stack=self.section.with_stack,
            )
            self.profiler.__enter__()
            self.started_at, self.first_step = time.perf_counter(), state.global_step + 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None and state.global_step >= self.first_step + self.section.steps - 1:
            self._finish(state.global_step, args.device.type == "cuda")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None:  # training ended inside the window
            self._finish(state.global_step, args.device.type == "cuda")

    def _finish(self, last_step: int, cuda: bool) -> None:
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started_at
        self.profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank{self.rank}.{int(time.time() * 1000)}.pt.trace.json"
        self.profiler.export_chrome_trace(str(trace))
        steps = last_step - self.first_step + 1
        text = summarize(self.profiler.key_averages(), wall, steps, cuda)
        header = f"profiled steps {self.first_step}-{last_step} on rank {self.rank}; trace: {trace}\n"
        self.summary_path = self.out / f"summary-rank{self.rank}.txt"
        self.summary_path.write_text(header + text, encoding="utf-8")
        if self.rank == 0:
            print(f"hftrain: profile written to {self.out}\n{header}{text.split(chr(10) + chr(10))[0]}", flush=True)
        self.profiler = None


def phase_seconds(averages: Any) -> dict[str, float]:
    """Host seconds inside each hftrain phase range (forward is nested in training_step: subtracted there)."""
    total = {e.key: e.cpu_time_total / 1e6 for e in averages if e.key.startswith("hftrain.")}
    forward = total.get("hftrain.forward", 0.0)
    return {
        "data wait": total.get("hftrain.data_wait", 0.0),
        "forward": forward,
        "backward": max(total.get("hftrain.training_step", 0.0) - forward, 0.0),
        "optimizer": total.get("hftrain.optimizer", 0.0) + total.get("hftrain.clip_grad_norm", 0.0),
    }


def summarize(averages: Any, wall: float, steps: int, cuda: bool) -> str:
    phases = phase_seconds(averages)
    phases["other (logging, callbacks, scheduler)"] = max(wall - sum(phases.values()), 0.0)
    lines = [f"where the step time went ({steps} steps, {wall:.3f} s, {wall / max(steps, 1):.3f} s/step):"]
    lines += [f"  {name:<40} {seconds:8.3f} s  {100 * seconds / wall:5.1f}%" for name, seconds in phases.items()]
    sort_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = averages.table(sort_by=sort_key, row_limit=TOP_OPERATIONS)
    return "\n".join(lines) + f"\n\ntop {TOP_OPERATIONS} operations by {sort_key}:\n{table}\n"
