"""Shared test fixtures: a small generated corpus, tiny recipes, and one tiny pretrained model per session."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_NOUNS = "cat dog bird fish horse cow sheep fox owl bear".split()
_ADJS = "red big small old young happy quiet fast slow green".split()
_VERBS = "sees follows likes chases finds helps meets watches".split()


def sentence(rng: random.Random) -> str:
    a, b = rng.choice(_ADJS), rng.choice(_ADJS)
    return f"the {a} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {b} {rng.choice(_NOUNS)}."


def make_documents(n: int, seed: int = 0) -> list[str]:
    """Documents of a few templated sentences: easy to learn, so a few steps visibly lower the loss."""
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus" / "train.jsonl", make_documents(600))


def tiny_recipe(data_path: Path, output_dir: Path, **training: Any) -> dict[str, Any]:
    """A recipe that trains in seconds on 2 CPU cores."""
    return {
        "model": {"preset": "cpu-tiny"},
        "tokenizer": {"train": {"vocab_size": 320, "max_documents": 2000}},
        "data": {"train": {"path": str(data_path)}, "seq_len": 32, "eval_blocks": 8, "holdout_every": 10},
        "training": {
            "output_dir": str(output_dir),
            "max_steps": 30,
            "per_device_train_batch_size": 8,
            "learning_rate": 3e-3,
            "warmup_steps": 0,
            "logging_steps": 1,
            "save_steps": 10,
            "report_to": "none",
            "disable_tqdm": True,
            **training,
        },
        "monitor": {"peak_tflops": 0.1, "sample_max_new_tokens": 8, "plot": False},
    }


@pytest.fixture
def make_recipe(corpus: Path, tmp_path: Path) -> Callable[..., Any]:
    """make_recipe(**training) -> validated Recipe for a tiny run in tmp_path/run."""
    from hftrain.recipe import load_recipe

    def make(**training: Any) -> Any:
        raw = tiny_recipe(corpus, tmp_path / "run", **training)
        return load_recipe(None, raw)

    return make


@pytest.fixture(scope="session")
def pretrained_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One tiny model trained once per test session (30 steps), shared by tests that need trained weights."""
    import hftrain

    root = tmp_path_factory.mktemp("pretrained")
    data = write_jsonl(root / "train.jsonl", make_documents(600))
    recipe = hftrain.load_recipe(None, tiny_recipe(data, root / "run"))
    return hftrain.train(recipe)


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m hftrain ARGS` as a user would, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hftrain", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


# Real local services for the S3 and hub tests (fixtures live in their own modules).
from .hub_server import local_hub  # noqa: E402,F401
from .s3_support import s3, s3_server  # noqa: E402,F401
