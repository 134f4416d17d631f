"""What a recipe's model is and what it costs, computed on the meta device (nothing is allocated).

Training FLOPs per token follow the PaLM appendix: 6 N + 12 L d T, where N counts the parameters that do
matmuls (all but the input embedding, so the output head is included), L layers, d hidden size, T context.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .model import meta_model, parameter_counts
from .recipe_schema import Recipe

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAMW_STATE_BYTES = 8  # two fp32 moments per parameter


def flops_per_token(counts: dict[str, int], config: Any, seq_len: int) -> float:
    matmul_params = counts["total"] - counts["embedding"]
    return 6.0 * matmul_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best matmul FLOP/s seen in a short burst: the MFU denominator when the recipe gives no peak."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    return best


def tokenizer_size_estimate(recipe: Recipe) -> tuple[int, bool]:
    """Tokenizer size without training one: (size, is a new tokenizer)."""
    tok = recipe.tokenizer
    if tok.train is not None:
        return tok.train.vocab_size, True
    if tok.path is not None:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(tok.path, trust_remote_code=tok.trust_remote_code)), False
    return 50257, False


def plan(recipe: Recipe) -> dict[str, Any]:
    size, is_new = tokenizer_size_estimate(recipe)
    model = meta_model(recipe, size, is_new)
    config = model.config
    counts = parameter_counts(model)
    per_token = flops_per_token(counts, config, recipe.data.seq_len)
    t = recipe.training
    tokens_per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * recipe.data.seq_len
    memory = {}
    for dtype, width in BYTES.items():
        weights = counts["total"] * width
        memory[dtype] = {"weights": weights, "gradients": weights, "optimizer": counts["total"] * ADAMW_STATE_BYTES}
    return {
        "shape": {
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "heads": config.num_attention_heads,
            "vocab": config.vocab_size,
            "context": config.max_position_embeddings,
        },
        "parameters": counts,
        "train_flops_per_token": per_token,
        "tokens_per_step_per_device": tokens_per_step,
        "train_flops_per_step_per_device": per_token * tokens_per_step,
        "memory_bytes": memory,
        "max_steps": t.max_steps,
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_plan(info: dict[str, Any], name: str) -> str:
    s, p = info["shape"], info["parameters"]
    lines = [
        f"model {name}: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, vocab {s['vocab']:,}, context {s['context']:,}",
        f"parameters: {p['total']:,} total = {p['embedding']:,} embedding + {p['head']:,} output head + {p['non_embedding']:,} non-embedding",
        f"training FLOPs per token: {info['train_flops_per_token']:.4g}  (6N + 12·L·d·T)",
        f"tokens per optimizer step per device: {info['tokens_per_step_per_device']:,} "
        f"-> {info['train_flops_per_step_per_device']:.4g} FLOPs",
        "memory for training with AdamW (activations not included):",
        f"  {'dtype':<6} {'weights':>12} {'gradients':>12} {'optimizer':>12} {'total':>12}",
    ]
    for dtype, m in info["memory_bytes"].items():
        total = m["weights"] + m["gradients"] + m["optimizer"]
        lines.append(f"  {dtype:<6} {_gb(m['weights']):>12} {_gb(m['gradients']):>12} {_gb(m['optimizer']):>12} {_gb(total):>12}")
    lines.append("  (bf16/fp16 autocast keeps fp32 weights: use the fp32 row; the bf16 row is for pure bf16 weights)")
    if info["max_steps"] and info["max_steps"] > 0:
        tokens = info["max_steps"] * info["tokens_per_step_per_device"]
        lines.append(f"run: {info['max_steps']:,} steps x {info['tokens_per_step_per_device']:,} tokens per device = {tokens:,} tokens per device, {tokens * info['train_flops_per_token']:.4g} FLOPs")
    return "\n".join(lines)
