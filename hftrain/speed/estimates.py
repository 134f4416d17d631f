"""`hftrain plan` / `hftrain.plan(recipe)`: what a recipe's model is and what it costs to train, computed on
the meta device (nothing is allocated): parameters, FLOPs, memory per dtype, per fine-tuning method and per
parallel strategy on N GPUs, with advice. Sizes and FLOPs come from model.measure_model.
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.checkpoint.adapter import DEFAULT_TARGETS
from hftrain.model.build import measure_model
from hftrain.parallel.dims import global_batch_of
from hftrain.recipe.schema import Recipe

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAMW_STATE_BYTES = 8  # two fp32 moments per parameter
BNB_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights


def plan(recipe: Recipe) -> dict[str, Any]:
    shape = measure_model(recipe)
    model, config, counts, per_token = shape.meta, shape.config, shape.counts, shape.flops_per_token
    tokens_per_step = global_batch_of(recipe) * recipe.data.seq_len
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
        "finetune_bytes": finetune_memory(model, recipe),
        "finetune_method": recipe.finetune.method,
        "max_steps": _planned_steps(recipe),
    }


def _planned_steps(recipe: Recipe) -> int | None:
    """max_steps as `train` derives it on one process (run_length.py); None when it needs the data's size."""
    from hftrain.errors import HftrainError
    from hftrain.training.run_length import resolve

    try:
        return resolve(recipe, recipe.training_kwargs(), 1, None).max_steps
    except HftrainError:
        return None


def quant_4bit_bytes(numel: int, double_quant: bool) -> float:
    """Packed 4-bit weights plus their quantization constants (fp32 absmax per block, or 8-bit with double quant)."""
    blocks = -(-numel // BNB_BLOCK)
    constants = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return numel / 2 + constants


def finetune_memory(model: Any, recipe: Recipe) -> dict[str, Any]:
    """Weights / gradients / AdamW bytes per fine-tuning method, as hftrain trains them: full and LoRA keep fp32
    weights; qlora / lora_8bit quantize every linear layer but the output head, and peft's
    prepare_model_for_kbit_training upcasts the rest (embeddings, head, norms, biases) to fp32."""
    lora = recipe.finetune.lora
    targets = lora.get("target_modules") or DEFAULT_TARGETS.get(model.config.model_type, [])
    targets = [targets] if isinstance(targets, str) else targets
    r = int(lora.get("r", 8))
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())
    quantized, rows, adapter, q4 = 0, 0, 0, 0.0
    double = recipe.finetune.quantization.bnb_4bit_use_double_quant
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        quantized += module.weight.numel()
        rows += module.out_features
        q4 += quant_4bit_bytes(module.weight.numel(), double)
        if name.rsplit(".", 1)[-1] in targets:
            adapter += r * (module.in_features + module.out_features)
    rest = total - quantized
    lora_state = {"gradients": 4 * adapter, "optimizer": ADAMW_STATE_BYTES * adapter}
    methods = {
        "full": {"trainable": total, "weights": 4 * total, "gradients": 4 * total, "optimizer": ADAMW_STATE_BYTES * total},
        "lora": {"trainable": adapter, "weights": 4 * (total + adapter), **lora_state},
        "qlora": {"trainable": adapter, "weights": int(q4) + 4 * (rest + adapter), **lora_state},
        "lora_8bit": {"trainable": adapter, "weights": quantized + 4 * rows + 4 * (rest + adapter), **lora_state},
    }
    return {
        "methods": methods,
        "lora_r": r,
        "targets": targets,
        "quantized_params": quantized,
        # 4-bit weights as loaded (the rest in bf16) against the same model in bf16
        "ratio_quantized_layers": q4 / (2 * quantized) if quantized else None,
        "ratio_whole_model": (q4 + 2 * rest) / (2 * total),
        "qlora_loaded_bytes": int(q4) + 2 * rest,
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
    lines += format_finetune(info["finetune_bytes"], info["finetune_method"])
    if info["max_steps"] and info["max_steps"] > 0:
        tokens = info["max_steps"] * info["tokens_per_step_per_device"]
        lines.append(f"run: {info['max_steps']:,} steps x {info['tokens_per_step_per_device']:,} tokens per device = {tokens:,} tokens per device, {tokens * info['train_flops_per_token']:.4g} FLOPs")
    return "\n".join(lines)


def format_finetune(ft: dict[str, Any], chosen: str) -> list[str]:
    lines = [
        f"memory by fine-tuning method (AdamW; LoRA r={ft['lora_r']} on {', '.join(ft['targets'])}; activations not included):",
        f"  {'method':<10} {'trainable':>13} {'weights':>12} {'gradients':>12} {'optimizer':>12} {'total':>12}",
    ]
    for method, m in ft["methods"].items():
        total = m["weights"] + m["gradients"] + m["optimizer"]
        mark = "  <- this recipe" if method == chosen else ""
        lines.append(f"  {method:<10} {m['trainable']:>13,} {_gb(m['weights']):>12} {_gb(m['gradients']):>12} "
                     f"{_gb(m['optimizer']):>12} {_gb(total):>12}{mark}")  # fmt: skip
    if ft["ratio_quantized_layers"] is not None:
        lines.append(
            f"  qlora 4-bit weights / bf16: {ft['ratio_quantized_layers']:.3f} for the {ft['quantized_params']:,} quantized "
            f"linear weights, {ft['ratio_whole_model']:.3f} for the whole model as loaded ({_gb(ft['qlora_loaded_bytes'])}; "
            "embeddings, head and norms stay bf16)"
        )
    return lines


TRAIN_BYTES_PER_PARAM = 16  # fp32 (or autocast) weights 4 + gradients 4 + AdamW moments 8
HEADROOM = 1.25  # activations, buffers and fragmentation, as a rough factor


def strategy_memory(info: dict[str, Any], gpus: int, gpu_mem_gb: float) -> tuple[list[tuple[str, float, str]], str]:
    """Per-GPU training memory (GB) for each strategy on `gpus` devices, and a recommendation with its reason."""
    n = info["parameters"]["total"]
    full = n * TRAIN_BYTES_PER_PARAM / 1e9
    rows = [
        ("DDP", full, "every GPU holds everything"),
        ("FSDP (full shard)", full / gpus, "weights, gradients and optimizer sharded"),
        ("ZeRO-3", full / gpus, "partitioned like FSDP"),
        ("ZeRO-3 + CPU offload", 2 * n / 1e9 / gpus, f"GPU keeps bf16 working weights; {full:,.0f} GB in host RAM"),
        ("device_map (pipeline)", full / gpus, "layers split, one GPU busy at a time"),
    ]
    budget = gpu_mem_gb / HEADROOM
    if full <= budget:
        advice = f"DDP: the whole training state ({full:,.1f} GB) fits one {gpu_mem_gb:g} GB GPU; plain data parallel is simplest and fastest."
    elif full / gpus <= budget:
        advice = (f"FSDP (or ZeRO-3): {full:,.0f} GB of training state does not fit one GPU, but sharded over {gpus} GPUs it is "
                  f"{full / gpus:,.1f} GB each, within {gpu_mem_gb:g} GB.")
    elif 2 * n / 1e9 / gpus <= budget:
        advice = (f"ZeRO-3 with CPU offload: even sharded the state needs {full / gpus:,.1f} GB per GPU; offloading it to host RAM "
                  f"({full:,.0f} GB in total) fits, at a speed cost. More GPUs, or LoRA/QLoRA fine-tuning, avoid that.")
    else:
        needed = int(-(-full * HEADROOM // gpu_mem_gb))
        advice = f"does not fit: full training needs about {needed} x {gpu_mem_gb:g} GB GPUs sharded (FSDP/ZeRO-3); or fine-tune with LoRA/QLoRA."
    return rows, advice


def format_strategies(info: dict[str, Any], gpus: int, gpu_mem_gb: float) -> str:
    rows, advice = strategy_memory(info, gpus, gpu_mem_gb)
    lines = [f"per-GPU training memory on {gpus} x {gpu_mem_gb:g} GB (AdamW, 16 bytes/parameter, activations not included):"]
    for name, gb, note in rows:
        fits = "fits" if gb * HEADROOM <= gpu_mem_gb else "too big"
        lines.append(f"  {name:<22} {gb:>9,.1f} GB  {fits:<8} {note}")
    lines.append(f"recommendation: {advice}")
    return "\n".join(lines)
