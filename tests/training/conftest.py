"""Fixtures shared by the training tests: a short quickstart model that the DPO tests start from."""

from __future__ import annotations

from pathlib import Path

import pytest

import hftrain
from hftrain.recipe.load import load_recipe


@pytest.fixture(scope="session")
def docs_model(tmp_path_factory):
    """A short quickstart: the shipped recipe's model and tokenizer, on the standard library's docstrings (60 steps,
    trained once per session for every DPO test)."""
    root = tmp_path_factory.mktemp("docs-model")
    raw = load_recipe(str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"), None).model_dump(exclude_unset=True)
    raw["training"].update(output_dir=str(root), max_steps=60, save_steps=60, eval_strategy="no", report_to="none",
                           disable_tqdm=True, bf16=False, torch_compile=False, logging_steps=40)  # fmt: skip
    raw["monitor"] = {"plot": False, "sample_max_new_tokens": 0, "peak_tflops": 0.1}
    return hftrain.train(load_recipe(None, raw)).final_dir
