"""Trainer callbacks: the JSONL metrics file, the throughput clock's start, the optimizer step's timing, and
preemption signals."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hftrain import progress
from hftrain.checkpoint.layout import RunLayout
from hftrain.training.step_flags import StepFlags
from hftrain.training.step_metrics import StepMetrics


class MetricsFileCallback(TrainerCallback):
    """Appends every log line (training and evaluation) to output_dir/metrics.jsonl, one JSON object per line."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
        path = RunLayout(Path(args.output_dir)).metrics
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class KeptCheckpointsCallback(TrainerCallback):
    """A checkpoint at every step recipe.checkpoints keeps (Pythia's schedule, log-spaced, a list), besides
    save_steps' own; the CheckpointManager's rotation leaves these alone."""

    def __init__(self, keeps: Callable[[int], bool]):
        self.keeps = keeps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.keeps(state.global_step):
            control.should_save = True


class StartupOverCallback(TrainerCallback):
    """The first step has ended: the progress bar and the logs speak from here (progress.py's watchdog stops)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        progress.stop()


class ThroughputClockCallback(TrainerCallback):
    """Starts the tokens/s clock after the first step of a (re)start, so start-up time is not counted; and times
    each optimizer step (between the Trainer's pre- and post-optimizer-step events) as the "optimizer" phase."""

    def __init__(self, metrics: StepMetrics):
        self.metrics = metrics
        self._optimizer_phase = ExitStack()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.metrics.start(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._optimizer_phase.enter_context(self.metrics.timer.phase("optimizer"))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._optimizer_phase.close()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.metrics.step_done(state.global_step)


class PreemptionCallback(TrainerCallback):
    """SIGTERM / SIGUSR1 (SLURM, spot instances): save a checkpoint at a step boundary, then stop.

    One process acts at the end of the step in which the signal arrived. Several processes agree on it through
    the steps' flags on the device (training/step_flags.py: one all-reduce, no host wait) and act at most two steps
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
