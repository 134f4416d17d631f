"""The bad-input tests' shared set-up: a folder holding a tiny recipe over good data and the broken inputs the
tables name ({good}, {bad}, {field}, {empty}, {notdir}, {tmp}, {recipe}, {annealing}, {ds_scheduler})."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ..support.data import make_documents, tiny_recipe, write_jsonl


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """tmp_path with r.yaml (4 steps saving every 2 into tmp_path/run) over good.jsonl, and the broken inputs."""
    good = write_jsonl(tmp_path / "good.jsonl", make_documents(300))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    write_jsonl(tmp_path / "field.jsonl", ["x"], field="body")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    (tmp_path / "not-a-model").mkdir()
    scheduled = {"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupDecayLR", "params": {}}}
    (tmp_path / "ds-scheduler.json").write_text(json.dumps(scheduled), encoding="utf-8")
    annealing = tiny_recipe(good, tmp_path / "run", max_steps=4, save_steps=2)
    del annealing["training"]["warmup_steps"]
    annealing["lr_schedule"] = {"type": "gpt_neox_annealing"}
    (tmp_path / "annealing.yaml").write_text(yaml.safe_dump(annealing), encoding="utf-8")
    raw = tiny_recipe(good, tmp_path / "run", max_steps=4, save_steps=2)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    return tmp_path


@pytest.fixture
def recipe_file(work: Path) -> Path:
    return work / "r.yaml"


def fill(work: Path) -> dict[str, str]:
    """The tables' placeholders."""
    names = {
        "good": "good.jsonl",
        "bad": "bad.jsonl",
        "field": "field.jsonl",
        "empty": "empty.jsonl",
        "notdir": "not-a-model",
        "recipe": "r.yaml",
        "ds_scheduler": "ds-scheduler.json",
        "annealing": "annealing.yaml",
    }
    return {"tmp": str(work), **{key: str(work / name) for key, name in names.items()}}
