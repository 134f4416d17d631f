"""Trainer callbacks: the JSONL metrics file, and the throughput clock's start."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"


class MetricsFileCallback(TrainerCallback):
    """Appends every log line (training and evaluation) to output_dir/metrics.jsonl, one JSON object per line."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
        path = Path(args.output_dir) / METRICS_FILE
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class ThroughputClockCallback(TrainerCallback):
    """Starts the trainer's tokens/s clock when training (re)starts, so start-up time is not counted."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.start_clock()
