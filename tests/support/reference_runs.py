"""The runs several slow tests compare against, each trained once per session at its first use (fixtures,
registered in tests/conftest.py). Tests read these directories and never write into them: a resume starts from a
copy (checks.copy_checkpoint).

* `sharded_yaml` and `backend_run(backend, nproc)`: a recipe over 8 shards, in fp32 without dropout or compile
  (so every launch gives the same per-step losses), a global batch of 8 sequences, saving every 4 of 8 steps; its
  2-process run on DDP, FSDP or ZeRO-3, or its plain 1-process run (`backend_run("ddp", 1)`). Used by the
  backend-agreement test, the sharded resume and export tests and the two-node tests.
* `finetune_probe(method, backend)`: a 6-step fine-tuning run of `pretrained_run`'s model (data.finetune_recipe)
  on 2 processes, with backend_probe's Inspector in every rank: what the quantized methods' checks read
  (test_backend_checks.py) and what test_finetune_distributed.py checks of their training, from one launch.
* `long_recipe` and `ddp_40_steps`: a one-file recipe of 40 steps saving every 5, and the per-step losses of its
  uninterrupted 2-process DDP run, which the lost-node, elastic and SLURM tests continue.

Before, each of those tests trained its own copy of the same reference (about 20 s per launch on 2 cores).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from .backend_probe import run_probe
from .checks import metrics_losses
from .cli import run_cli
from .data import finetune_recipe, make_documents, tiny_recipe, write_jsonl
from .workers import built_once

STEPS, SAVE = 8, 4
LONG_STEPS, LONG_SAVE = 40, 5


def train(recipe: Path, backend: str, nproc: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """1 or 2 processes of `backend`; DDP on 1 process is the plain single-process run (same checkpoint format)."""
    launch = [] if backend == "ddp" and nproc == 1 else ["--accelerate-config", backend, "--nproc", str(nproc)]
    result = run_cli("train", str(recipe), *launch, f"training.output_dir={out}", *extra)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="session")
def sharded_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe over 8 shards (so the default is 8 readers on any launch) with a global batch of 8 sequences."""
    return built_once(tmp_path_factory, "sharded", _write_sharded)


def _write_sharded(root: Path) -> Path:
    docs = make_documents(640)
    for s in range(8):
        write_jsonl(root / "corpus" / f"part-{s}.jsonl", docs[s::8])
    raw = tiny_recipe(
        root / "corpus",
        root / "unused",
        max_steps=STEPS,
        save_steps=SAVE,
        per_device_train_batch_size=2,
        bf16=False,
        fp16=False,
        torch_compile=False,
        eval_strategy="no",
    )
    raw["model"].update(hidden_dropout=0, attention_dropout=0)
    raw["monitor"]["sample_max_new_tokens"] = 0
    raw["parallelism"] = {"global_batch_size": 8}
    raw["data"]["shuffle_window"] = 4
    path = root / "sharded.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def backend_run(sharded_yaml: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    """backend_run("fsdp", 2) -> the run directory of that launch of `sharded_yaml`, trained at its first use.
    The launch's output is kept beside it (`launch.log`)."""
    runs: dict[tuple[str, int], Path] = {}

    def build(backend: str, nproc: int, folder: Path) -> Path:
        out = folder / "run"
        result = train(sharded_yaml, backend, nproc, out)
        (folder / "launch.log").write_text(result.stdout + result.stderr, encoding="utf-8")
        return out

    def get(backend: str, nproc: int) -> Path:
        if (backend, nproc) not in runs:
            runs[backend, nproc] = built_once(
                tmp_path_factory, f"backend-{backend}-x{nproc}", lambda f: build(backend, nproc, f)
            )
        return runs[backend, nproc]

    return get


FINETUNE_STEPS = 6


def finetune_recipe_file(base: Path, folder: Path, method: str, **training) -> Path:
    """folder/METHOD.yaml: FINETUNE_STEPS steps of `method` on `base`, logging every step, saving at the end."""
    raw = finetune_recipe(
        base, folder, method, max_steps=FINETUNE_STEPS, save_steps=FINETUNE_STEPS, logging_steps=1, **training
    )
    path = folder / f"{method}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def finetune_probe(
    pretrained_run, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], tuple[list[dict], Path]]:
    """finetune_probe("qlora", "fsdp") -> (every rank's observations, the folder whose `out` is the run directory),
    launched at its first use."""
    runs: dict[tuple[str, str], tuple[list[dict], Path]] = {}
    root = tmp_path_factory.mktemp("finetune-probes")  # per worker: its base is this worker's pretrained_run

    def get(method: str, backend: str) -> tuple[list[dict], Path]:
        if (method, backend) not in runs:
            folder = root / f"{method}-{backend}"
            folder.mkdir()
            recipe = finetune_recipe_file(pretrained_run.final_dir, folder, method, output_dir=str(folder / "out"))
            runs[method, backend] = run_probe(recipe, folder / "probe", backend), folder
        return runs[method, backend]

    return get


@pytest.fixture(scope="session")
def long_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 one-file documents, 40 steps saving every 5, no sample generation."""
    return built_once(tmp_path_factory, "long", _write_long)


def _write_long(root: Path) -> Path:
    raw = tiny_recipe(
        write_jsonl(root / "docs.jsonl", make_documents(400)),
        root / "unused",
        max_steps=LONG_STEPS,
        save_steps=LONG_SAVE,
    )
    raw["monitor"]["sample_max_new_tokens"] = 0
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def ddp_40_steps(long_recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """{step: loss} of `long_recipe`'s uninterrupted 2-process DDP run."""

    def build(folder: Path) -> dict[int, float]:
        train(long_recipe, "ddp", 2, folder / "run")
        return metrics_losses(folder / "run")

    return built_once(tmp_path_factory, "ddp-40-steps", build)
