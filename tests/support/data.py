"""Generated training data and tiny recipes: a small templated corpus that a few steps visibly learn."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

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


# The speed levers a test recipe sets, so that the speed probe (2-24 s the first time per shape) runs only in the
# tests of the speed defaults (tests/speed/test_speed.py, measured_speed=True) and the README's recipes, and a
# test's numbers do not depend on what the probe measured on the machine at hand (unpinned, an AMX CPU chose bf16
# for the fine-tuning recipe where another chose fp32, and two tests failed only there).
PINNED_SPEED = {"bf16": False, "torch_compile": False}


def tiny_recipe(data_path: Path, output_dir: Path, measured_speed: bool = False, **training: Any) -> dict[str, Any]:
    """A recipe that trains in seconds on 2 CPU cores; fp32 without compile unless `measured_speed` leaves the
    speed levers to hftrain's measured defaults."""
    training = {**({} if measured_speed else PINNED_SPEED), **training}
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


# ---------------------------------------------------------------------------------------------- fine-tuning data

COLOUR = {
    "cat": "red",
    "dog": "green",
    "bird": "quiet",
    "fish": "old",
    "horse": "big",
    "cow": "small",
    "sheep": "happy",
    "fox": "fast",
    "owl": "slow",
    "bear": "young",
}


def instructions(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        noun = rng.choice(list(COLOUR))
        out.append({"prompt": f"{sentence(rng)} the {noun} is", "completion": f" {COLOUR[noun]}."})
    return out


def write_examples(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def finetune_recipe(base, tmp_path, method, **training):
    return {
        "model": {"from_pretrained": str(base)},
        "tokenizer": {"path": str(base)},
        "data": {
            "train": {
                "path": str(write_examples(tmp_path / "train.jsonl", instructions(400, 1))),
                "format": "prompt_completion",
            },
            "validation": {
                "path": str(write_examples(tmp_path / "held.jsonl", instructions(40, 2))),
                "format": "prompt_completion",
            },
            "seq_len": 64,
            "eval_blocks": 16,
        },
        "finetune": {"method": method, "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}},
        "training": {
            "output_dir": str(tmp_path / method),
            "max_steps": 30,
            "per_device_train_batch_size": 8,
            "learning_rate": 3e-3,
            "warmup_steps": 0,
            "logging_steps": 5,
            "save_steps": 30,
            "eval_on_start": True,
            "eval_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            **PINNED_SPEED,
            **training,
        },
        "monitor": {"peak_tflops": 0.1, "sample_max_new_tokens": 4, "plot": False, "sample_prompt": "the fox is"},
    }
