"""GPU tier: `hftrain plan`'s predicted peak per GPU against torch.cuda.max_memory_allocated of real steps
(within 10%), for full bf16 training with and without gradient checkpointing and for LoRA (onto the same shape
saved as a pretrained model): the allocator-counted part of the prediction (the CUDA context is listed apart)."""

from __future__ import annotations

import pytest

from . import support

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from benchmarks.finetune_memory import build_base

    return build_base(tmp_path_factory.mktemp("base"))  # pythia-160m, random weights, GPT-2 tokenizer


@pytest.mark.parametrize("method,checkpointing", [("full", False), ("full", True), ("lora", False)])
def test_predicted_peak_matches_max_memory_allocated(tmp_path, method, checkpointing, request):
    import torch
    from transformers import TrainerCallback

    import hftrain
    from hftrain.planning.estimates import plan
    from hftrain.planning.memory import predict_peak, run_shape
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    raw = {
        "model": {"preset": "pythia-160m"},
        "tokenizer": {"builtin": "gpt2"},
        "data": {"train": {"builtin": "python-docs"}, "seq_len": 1024, "eval_blocks": 4, "holdout_every": 10},
        "training": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 3,
            "per_device_train_batch_size": 8,
            "per_device_eval_batch_size": 4,
            "bf16": True,
            "gradient_checkpointing": checkpointing,
            "save_steps": 1000,
            "report_to": "none",
            "torch_compile": False,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }
    if method == "lora":
        raw["finetune"] = {"method": "lora", "lora": {"r": 16}}
        raw["model"], raw["tokenizer"] = {"from_pretrained": str(request.getfixturevalue("base"))}, {}
    recipe = load_recipe(None, raw)
    predicted = predict_peak(PlanPart.of(recipe), plan(PlanPart.of(recipe)), run_shape(PlanPart.of(recipe), "cuda", 1))

    class Peak(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            torch.cuda.reset_peak_memory_stats()

    torch.cuda.empty_cache()
    hftrain.train(recipe, callbacks=[Peak()])
    measured = torch.cuda.max_memory_allocated()
    support.record(
        "plan",
        f"{method}-checkpointing-{checkpointing}",
        {"predicted_gb": predicted.total / 1e9, "measured_gb": measured / 1e9, "phase": predicted.phase},
    )
    assert predicted.total == pytest.approx(measured, rel=0.10)
