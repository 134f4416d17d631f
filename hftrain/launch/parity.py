"""`hftrain parity RECIPE --steps 20`: the same run on single / DDP / FSDP / ZeRO-3, compared step by step.

Every backend sees the same global batch: the distributed runs use 2 processes with half the batch each; the
single process accumulates two half batches read by 2 DataLoader workers. The data order belongs to the run's
logical readers, not to the launch (parallel/readers.py), so those are the same blocks and per-step loss and grad-norm
must agree to float rounding. Forced for comparability: fp32, no dropout, no compile, no checkpoints.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.layout import RunLayout
from hftrain.errors import HftrainError
from hftrain.parallel.batch import global_batch
from hftrain.parallel.dims import Strategy
from hftrain.planning.part import PlanPart

# by label: single, DDP, ...
BACKENDS = {s.label: s for s in (Strategy.SINGLE, Strategy.DDP, Strategy.FSDP, Strategy.ZERO3)}
FORCED = [
    "training.logging_steps=1",
    "training.save_strategy=no",
    "training.eval_strategy=no",
    "training.bf16=false",
    "training.fp16=false",
    "training.torch_compile=false",
    "training.report_to=none",
    "model.hidden_dropout=0",
    "model.attention_dropout=0",
    "monitor.sample_max_new_tokens=0",
    "monitor.plot=false",
    "parallelism.strategy=auto",
    "parallelism.global_batch_size=null",
]


def parity(
    recipe_path: str, overrides: list[str], part: PlanPart, steps: int, backends: list[str], tolerance: float
) -> int:
    total = global_batch(part.batch, 1)  # as one process runs it
    if total % 2:
        raise HftrainError(f"parity: the global batch ({total} sequences) must be even to split it over 2 processes.")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise HftrainError(f"parity --backends: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    root = Path(part.output_dir) / "parity"
    runs: dict[str, dict[str, Any]] = {}
    for label in backends:
        out = root / label.lower().replace("-", "")
        shutil.rmtree(out, ignore_errors=True)
        common = [
            *overrides,
            *FORCED,
            f"training.max_steps={steps}",
            f"training.output_dir={out}",
            f"training.per_device_train_batch_size={total // 2}",
        ]
        if BACKENDS[label].accelerate_config is None:
            cmd = [
                "train",
                recipe_path,
                *common,
                "training.gradient_accumulation_steps=2",
                "training.dataloader_num_workers=2",
            ]
        else:
            cmd = [
                "train",
                recipe_path,
                "--accelerate-config",
                BACKENDS[label].accelerate_config,
                "--nproc",
                "2",
                *common,
                "training.gradient_accumulation_steps=1",
                "training.dataloader_num_workers=0",
            ]
        print(f"parity: running {label} ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "hftrain", *cmd], capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise HftrainError(f"parity: the {label} run failed (exit {done.returncode}); its last lines:\n{tail}")
        runs[label] = read_run(out)
    print(format_table(runs, steps))
    loss_diff, norm_diff = max_differences(runs)
    print(f"parity: max relative loss diff {loss_diff:.3g}, grad-norm diff {norm_diff:.3g}")
    return 0 if max(loss_diff, norm_diff) <= tolerance else 1


def read_run(out: Path) -> dict[str, Any]:
    layout = RunLayout(out)
    lines = [json.loads(line) for line in layout.metrics.read_text(encoding="utf-8").splitlines()]
    results = read_json(layout.results, "the run's results")
    steps = {e["step"]: (e["loss"], e["grad_norm"]) for e in lines if "loss" in e and "grad_norm" in e}
    return {"steps": steps, "distributed_type": results["distributed_type"], "world_size": results["world_size"]}


def max_differences(runs: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """Largest relative loss and grad-norm differences of every run from the single-process one."""
    reference = runs.get("single") or next(iter(runs.values()))
    worst = [step_differences(reference, run, reference["steps"]) for run in runs.values()]
    return max(w[0] for w in worst), max(w[1] for w in worst)


def step_differences(reference: dict[str, Any], other: dict[str, Any], steps: Iterable[int]) -> tuple[float, float]:
    """Largest relative loss and grad-norm differences of `other` from `reference` over `steps` (inf where a step
    is missing from either)."""
    loss_diff = norm_diff = 0.0
    for step in steps:
        if step not in reference["steps"] or step not in other["steps"]:
            return float("inf"), float("inf")
        (a, na), (b, nb) = reference["steps"][step], other["steps"][step]
        loss_diff = max(loss_diff, abs(b - a) / abs(a))
        norm_diff = max(norm_diff, abs(nb - na) / max(abs(na), 1e-12))
    return loss_diff, norm_diff


def format_table(runs: dict[str, dict[str, Any]], steps: int) -> str:
    labels = list(runs)
    head = f"{'step':>4}  " + "  ".join(f"{label + ' loss':>12} {label + ' gnorm':>13}" for label in labels)
    kinds = "      " + "  ".join(
        f"{runs[label]['distributed_type'] + ' x' + str(runs[label]['world_size']):>26}" for label in labels
    )
    rows = [kinds, head]
    for step in range(1, steps + 1):
        cells = []
        for label in labels:
            loss, norm = runs[label]["steps"].get(step, (float("nan"), float("nan")))
            cells.append(f"{loss:>12.6f} {norm:>13.6f}")
        rows.append(f"{step:>4}  " + "  ".join(cells))
    return "\n".join(rows)
