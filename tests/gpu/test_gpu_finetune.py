"""GPU tier, item 2: full, LoRA, QLoRA and 8-bit LoRA fine-tuning on CUDA with bitsandbytes' real CUDA kernels,
on the pythia-160m preset (random weights, saved as a pretrained model): the 4-bit / bf16 weight ratio as loaded,
peak GPU memory per method, each method's layers checked (tests/support/backend_checks.py)."""

from __future__ import annotations

import pytest

from ..support.backend_checks import check_quantized
from ..support.backend_probe import run_probe
from . import support

pytestmark = pytest.mark.gpu
ITEM = "finetune"
METHODS = {"full": 1e-4, "lora": 2e-3, "qlora": 2e-3, "lora_8bit": 2e-3}  # learning rates
STEPS, SEQ, BATCH = 20, 256, 8
peaks: dict[str, float] = {}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from benchmarks.finetune_memory import build_base

    return build_base(tmp_path_factory.mktemp("base"))


def recipe(base, method: str, out) -> dict:
    data = support.ROOT / "recipes" / "finetune" / "data"
    return {
        "model": {"from_pretrained": str(base)},
        "tokenizer": {"path": str(base)},
        "data": {
            "train": {"path": str(data / "train.jsonl"), "format": "prompt_completion"},
            "validation": {"path": str(data / "validation.jsonl"), "format": "prompt_completion"},
            "seq_len": SEQ,
            "eval_blocks": 8,
        },
        "finetune": {"method": method, "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}},
        "training": {
            "output_dir": str(out),
            "max_steps": STEPS,
            "per_device_train_batch_size": BATCH,
            "learning_rate": METHODS[method],
            "warmup_steps": 2,
            "logging_steps": 5,
            "save_steps": 10_000,
            "eval_strategy": "no",
            "bf16": True,
            "report_to": "none",
            "disable_tqdm": True,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }


@pytest.mark.parametrize("method", list(METHODS))
def test_finetune_method_on_cuda(base, tmp_path, method):
    out = tmp_path / method
    recipe_file = support.write_recipe(recipe(base, method, out), tmp_path / f"{method}.yaml")
    observations = run_probe(recipe_file, tmp_path / "probe", backend=None)  # one process, a fresh CUDA context
    r, losses = support.results(out), support.logged(out)
    steps = sorted(losses)
    assert r["distributed_type"] == "NO" and losses[steps[-1]] < losses[steps[0]], losses
    params = observations[0]["step_end"]["params"]
    assert all(p["device"].startswith("cuda") for p in params.values())
    numbers = {
        "peak_mem_gb": r["peak_mem_gb"],
        "tokens_per_s": r["tokens_per_s_median"],
        "first_loss": losses[steps[0]],
        "last_loss": losses[steps[-1]],
        "trainable": sum(p["numel"] for p in params.values() if p["trainable"]),
    }
    if method in ("qlora", "lora_8bit"):
        summary = check_quantized(observations[0], method)
        assert all(q["device"].startswith("cuda") for q in observations[0]["step_end"]["quantized"].values())
        numbers.update(quantized_layers=summary["layers"], packed_weight_ratio=summary["ratio_to_bf16"])
    peaks[method] = r["peak_mem_gb"]
    support.record(ITEM, f"finetune_{method}", numbers)
    if method == "qlora" and "full" in peaks:
        assert peaks["qlora"] < peaks["full"]


def test_qlora_weights_as_loaded_on_cuda(base, tmp_path):
    """hftrain's own loader quantizes on the GPU: the 4-bit / bf16 weight ratio of the quantized layers (absmax and
    code maps included) and of the whole model (embeddings and head stay bf16)."""
    import torch

    from benchmarks.finetune_memory import weight_bytes
    from hftrain.model.build import load_pretrained
    from hftrain.model.part import ModelPart
    from hftrain.recipe.load import load_recipe

    torch.cuda.reset_peak_memory_stats()
    model = load_pretrained(ModelPart.of(load_recipe(None, recipe(base, "qlora", tmp_path / "unused"))))
    loaded = weight_bytes(model)
    first = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    assert first.weight.device.type == "cuda" and first.weight.dtype == torch.uint8
    other_numel = sum(p.numel() for p in [*model.parameters(), *model.buffers()] if type(p).__name__ != "Params4bit")
    layers = loaded["quantized"] / loaded["quantized_bf16"]
    whole = (loaded["quantized"] + loaded["other"]) / (loaded["quantized_bf16"] + 2 * other_numel)  # vs all-bf16
    assert layers <= 0.30 and whole < 0.8  # README (CPU): 0.258 and 0.612
    support.record(
        ITEM,
        "qlora_weights_as_loaded",
        {
            "ratio_quantized_layers": layers,
            "ratio_whole_model": whole,
            "quantized_bytes": loaded["quantized"],
            "bf16_bytes": loaded["quantized_bf16"],
            "load_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        },
    )
