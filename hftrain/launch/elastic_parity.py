"""`hftrain parity RECIPE --elastic`: does a run continue exactly on another process count, for each backend?

Per backend (DDP, FSDP, ZeRO-3), four runs of `steps` steps with a checkpoint half-way: on 2 processes, on 1,
then the 2-process checkpoint continued on 1 process and the 1-process checkpoint on 2. The resumed steps are
compared with the run they continue, and the 1- and 2-process runs with each other from step 1 (the data order
belongs to the run, not the launch). Forced like plain parity: fp32, eager, no dropout; the global batch is
fixed and gradient accumulation derived per launch, and the readers are fixed so both launches divide them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import RunLayout
from hftrain.data.loader import plan_data
from hftrain.errors import HftrainError
from hftrain.launch.parity import FORCED, read_run, step_differences
from hftrain.parallel.batch import global_batch
from hftrain.parallel.dims import Strategy
from hftrain.parallel.readers import default_readers
from hftrain.planning.part import PlanPart

BACKENDS = {s.label: s.value for s in (Strategy.DDP, Strategy.FSDP, Strategy.ZERO3)}  # by label: DDP, FSDP, ZeRO-3


def elastic_parity(
    recipe_path: str, overrides: list[str], part: PlanPart, steps: int, backends: list[str], tolerance: float
) -> int:
    total = global_batch(part.batch, 1)  # as one process runs it
    if total % 2 or steps < 2:
        raise HftrainError(
            "parity --elastic: needs an even global batch (it is "
            f"{total}) and --steps of at least 2 (a checkpoint half-way)."
        )
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise HftrainError(
            f"parity --elastic --backends: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}"
        )
    readers = part.data.readers or default_readers(plan_data(part.data, part.seed).reader_limit, 2, 1)
    half = steps // 2
    common = [
        *overrides,
        *FORCED,
        f"training.max_steps={steps}",
        "training.save_strategy=steps",
        f"training.save_steps={half}",
        f"parallelism.global_batch_size={total}",
        f"training.per_device_train_batch_size={total // 2}",
        "training.dataloader_num_workers=0",
        f"data.readers={readers}",
    ]
    common.remove("parallelism.global_batch_size=null")
    root = Path(part.output_dir) / "parity-elastic"
    rows, loss_diff, norm_diff = [], 0.0, 0.0
    for label in backends:
        runs = _elastic_runs(recipe_path, label, root, common, half)
        pairs = {
            "1 vs 2": (runs["2"], runs["1"], range(1, steps + 1)),
            "2->1": (runs["2"], runs["2->1"], range(half + 1, steps + 1)),
            "1->2": (runs["1"], runs["1->2"], range(half + 1, steps + 1)),
        }
        cells = []
        for name, (reference, other, which) in pairs.items():
            loss, norm = step_differences(reference, other, which)
            loss_diff, norm_diff = max(loss_diff, loss), max(norm_diff, norm)
            cells.append(f"{loss:>12.2g} {norm:>12.2g}")
        rows.append(f"{label:<7} " + "  ".join(cells))
    head = f"{'backend':<7} " + "  ".join(
        f"{name + ' loss':>10} {name + ' gnorm':>10}" for name in ("1 vs 2", "2->1", "1->2")
    )
    print(
        "\n".join(
            [f"relative differences; resumed steps {half + 1}-{steps} against the run they continue", head, *rows]
        )
    )
    print(f"elastic: max relative loss diff {loss_diff:.3g}, grad-norm diff {norm_diff:.3g}")
    return 0 if max(loss_diff, norm_diff) <= tolerance else 1


def _elastic_runs(recipe_path: str, label: str, root: Path, common: list[str], half: int) -> dict[str, Any]:
    """One backend's four runs: on 2 and on 1 process(es) from the start, then each continued from its
    checkpoint-{half} on the other process count."""
    backend, out = BACKENDS[label], root / BACKENDS[label]
    shutil.rmtree(out, ignore_errors=True)
    runs: dict[str, Any] = {}
    for name, nproc, source in (("2", 2, None), ("1", 1, None), ("2->1", 1, "2"), ("1->2", 2, "1")):
        run_dir = out / name.replace("->", "-to-")
        if source is not None:
            _continue_from(out / source, run_dir, f"checkpoint-{half}")
        print(f"parity --elastic: {label} {name} ...", flush=True)
        _train(recipe_path, backend, nproc, run_dir, common, label)
        runs[name] = read_run(run_dir)
        first = min(runs[name]["steps"], default=None)
        if source is not None and first != half + 1:  # else a fresh start would compare equal
            raise HftrainError(
                f"parity --elastic: the {label} {name} run did not continue from checkpoint-{half} "
                f"(its first logged step is {first}); see {run_dir}"
            )
    return runs


def _continue_from(source: Path, target: Path, checkpoint: str) -> None:
    """A run directory as `source` would have left it had it stopped after `checkpoint`."""
    target.mkdir(parents=True)
    for name in (checkpoint, RunLayout.TOKENIZER_DIR, RunLayout.RUN_FILE):
        if (source / name).is_dir():
            shutil.copytree(source / name, target / name)
        elif (source / name).is_file():
            shutil.copy(source / name, target / name)


def _train(recipe_path: str, backend: str, nproc: int, out: Path, common: list[str], label: str) -> None:
    launch = [] if backend == "ddp" and nproc == 1 else ["--accelerate-config", backend, "--nproc", str(nproc)]
    cmd = [sys.executable, "-m", "hftrain", "train", recipe_path, *launch, *common, f"training.output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise HftrainError(
            f"parity --elastic: the {label} run on {nproc} process(es) "
            f"failed (exit {done.returncode}); its last lines:\n{tail}"
        )
