"""`hftrain plan` / `hftrain.plan(recipe)`: what a recipe's model is and what it costs to train, computed from
the model's numbers (model/shape.py: nothing is built or allocated): parameters, FLOPs, memory per dtype, per
fine-tuning method and per parallel strategy on N GPUs, with advice. Sizes and FLOPs come from
model.shape.measure_model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hftrain.checkpoint.adapter import DEFAULT_TARGETS
from hftrain.model.shape import ModelShape, measure_model
from hftrain.parallel.batch import global_batch
from hftrain.planning.fit import MARGIN, Fit, Machine, step_time
from hftrain.planning.memory import CUDA_CONTEXT_BYTES
from hftrain.planning.part import PlanPart
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.speed import fp8

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAMW_STATE_BYTES = 8  # two fp32 moments per parameter
BNB_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights


def plan(part: PlanPart, shape: ModelShape | None = None) -> dict[str, Any]:
    shape = shape or measure_model(part.model)
    config, counts, per_token = shape.dims, shape.counts, shape.flops_per_token
    rows = OBJECTIVES[
        part.finetune.objective
    ].rows_per_example  # DPO: a pair's chosen and rejected answers, each up to seq_len
    tokens_per_step = global_batch(part.batch, 1) * part.data.seq_len * rows
    memory = {}
    for dtype, width in BYTES.items():
        weights = counts["total"] * width
        memory[dtype] = {"weights": weights, "gradients": weights, "optimizer": counts["total"] * ADAMW_STATE_BYTES}
    return {
        "config": config,
        "matmul_params": shape.matmul_params,
        "largest_layer_params": shape.largest_block_params,
        "layer_params": shape.all_block_params,
        "shape": {
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "heads": config.num_attention_heads,
            "vocab": config.vocab_size,
            "context": config.max_position_embeddings,
        },
        "parameters": counts,
        "train_flops_per_token": per_token,
        "flops_formula": "8N + 16·L·d·T: DPO, with the reference's forward" if rows == 2 else "6N + 12·L·d·T",
        "tokens_per_step_per_device": tokens_per_step,
        "train_flops_per_step_per_device": per_token * tokens_per_step,
        "memory_bytes": memory,
        "finetune_bytes": finetune_memory(shape, part),
        "finetune_method": part.finetune.method,
        "max_steps": _planned_steps(part),
        "fp8_layers": fp8.summary(shape),  # which linear layers speed.fp8 would convert (speed/fp8.py)
    }


def _planned_steps(part: PlanPart) -> int | None:
    """max_steps as `train` derives it on one process (run_length.py); None when it needs the data's size."""
    from hftrain.errors import HftrainError

    try:
        return part.run_length.build(1, None).max_steps
    except HftrainError:
        return None


def quant_4bit_bytes(numel: int, double_quant: bool) -> float:
    """Packed 4-bit weights plus their quantization constants (fp32 absmax per block, or 8-bit with double quant)."""
    blocks = -(-numel // BNB_BLOCK)
    constants = blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks
    return numel / 2 + constants


def finetune_memory(shape: ModelShape, part: PlanPart) -> dict[str, Any]:
    """Weights / gradients / AdamW bytes per fine-tuning method, as hftrain trains them: full and LoRA keep fp32
    weights; qlora / lora_8bit quantize every linear layer but the output head, and peft's
    prepare_model_for_kbit_training upcasts the rest (embeddings, head, norms, biases) to fp32."""
    lora = part.finetune.lora
    targets = lora.get("target_modules") or DEFAULT_TARGETS.get(shape.dims.model_type, [])
    targets = [targets] if isinstance(targets, str) else targets
    r = int(lora.get("r", 8))
    total = shape.counts["total"]
    quantized, rows, adapter, q4 = 0, 0, 0, 0.0
    double = part.finetune.quantization.bnb_4bit_use_double_quant
    for linear in shape.linears:
        if linear.head:
            continue
        quantized += linear.params
        rows += linear.out_features
        q4 += quant_4bit_bytes(linear.params, double)
        if linear.name.rsplit(".", 1)[-1] in targets:
            adapter += r * (linear.in_features + linear.out_features)
    rest = total - quantized
    lora_state = {"gradients": 4 * adapter, "optimizer": ADAMW_STATE_BYTES * adapter}
    methods = {
        "full": {
            "trainable": total,
            "weights": 4 * total,
            "gradients": 4 * total,
            "optimizer": ADAMW_STATE_BYTES * total,
        },
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
        f"model {name}: {s['layers']} layers, hidden {s['hidden']}, "
        f"{s['heads']} heads, vocab {s['vocab']:,}, context {s['context']:,}",
        f"parameters: {p['total']:,} total = {p['embedding']:,} embedding + {p['head']:,} output head + "
        f"{p['non_embedding']:,} non-embedding",
        f"training FLOPs per token: {info['train_flops_per_token']:.4g}  ({info['flops_formula']})",
        f"tokens per optimizer step per device: {info['tokens_per_step_per_device']:,} "
        f"-> {info['train_flops_per_step_per_device']:.4g} FLOPs",
        "training state with AdamW (weights, gradients, optimizer; the peak below adds the rest):",
        f"  {'dtype':<6} {'weights':>12} {'gradients':>12} {'optimizer':>12} {'total':>12}",
    ]
    for dtype, m in info["memory_bytes"].items():
        total = m["weights"] + m["gradients"] + m["optimizer"]
        lines.append(
            f"  {dtype:<6} {_gb(m['weights']):>12} {_gb(m['gradients']):>12} {_gb(m['optimizer']):>12} {_gb(total):>12}"
        )
    lines.append("  (bf16/fp16 autocast keeps fp32 weights: use the fp32 row; the bf16 row is for pure bf16 weights)")
    lines += format_finetune(info["finetune_bytes"], info["finetune_method"])
    if info["max_steps"] and info["max_steps"] > 0:
        tokens = info["max_steps"] * info["tokens_per_step_per_device"]
        lines.append(
            f"run: {info['max_steps']:,} steps x {info['tokens_per_step_per_device']:,} tokens per device = {tokens:,} "
            f"tokens per device, {tokens * info['train_flops_per_token']:.4g} FLOPs"
        )
    return "\n".join(lines)


def format_fp8(info: dict[str, Any], setting: str | None, card_has_fp8: bool) -> list[str]:
    """speed.fp8's layers and what to expect at this width; with it off, a hint where FP8 should pay (a wide model on
    a card with FP8). `card_has_fp8`: the planned GPU has FP8 tensor cores (compute capability 8.9 or newer)."""
    hidden = info["shape"]["hidden"]
    if setting:
        lines = [fp8.describe(info["fp8_layers"], setting), f"  expect: {fp8.expectation(hidden)}"]
        if not card_has_fp8:
            lines.append(
                "  `hftrain train` refuses speed.fp8 here (no GPU with FP8); plan for one with --gpus N --gpu-type H100"
            )
        return lines
    if card_has_fp8 and hidden >= fp8.PAYS_FROM_HIDDEN:
        return [
            f"fp8: off; at hidden {hidden:,} speed.fp8: tensorwise may "
            f"train faster ({fp8.PUBLISHED}; pip install 'hftrain[fp8]')"
        ]
    return []


def format_finetune(ft: dict[str, Any], chosen: str) -> list[str]:
    lines = [
        f"memory by fine-tuning method (AdamW; LoRA r={ft['lora_r']} "
        f"on {', '.join(ft['targets'])}; the training state):",
        f"  {'method':<10} {'trainable':>13} {'weights':>12} {'gradients':>12} {'optimizer':>12} {'total':>12}",
    ]
    for method, m in ft["methods"].items():
        total = m["weights"] + m["gradients"] + m["optimizer"]
        mark = "  <- this recipe" if method == chosen else ""
        lines.append(
            f"  {method:<10} {m['trainable']:>13,} {_gb(m['weights']):>12} {_gb(m['gradients']):>12} "
            f"{_gb(m['optimizer']):>12} {_gb(total):>12}{mark}"
        )
    if ft["ratio_quantized_layers"] is not None:
        lines.append(
            f"  qlora 4-bit weights / bf16: {ft['ratio_quantized_layers']:.3f} for the {ft['quantized_params']:,} "
            f"quantized linear weights, {ft['ratio_whole_model']:.3f} for the whole model as loaded "
            f"({_gb(ft['qlora_loaded_bytes'])}; embeddings, head and norms stay bf16)"
        )
    return lines


def format_peak(fit: Fit, machine: Machine) -> list[str]:
    """The predicted peak per process by component, for the layout in `fit`."""
    s, peak = fit.shape, fit.peak
    where = "CPU process" if s.device == "cpu" else "GPU"
    lines = [
        f"peak memory per {where} ({s.strategy} on {machine.description}; {s.dtype}, micro-batch {s.micro_batch} x "
        f"{s.seq_len} tokens, evaluation batch {s.eval_batch}, {s.attention}, gradient checkpointing "
        f"{'on' if s.checkpointing else 'off'}):"
    ]
    for name, value in peak.parts.items():
        lines.append(f"  {name:<28} {_gb(value):>10}{PART_NOTES.get(name, '')}")
    other = "a training step" if peak.phase == "final evaluation" else "the final evaluation"
    lines.append(
        f"predicted peak: {peak.total / 1e9:.2f} GB per process (at the {peak.phase}; {other}: "
        f"{_gb(peak.other_phase_total)})"
    )
    if s.device == "cuda":
        lines.append(
            "  (as torch.cuda.max_memory_allocated counts it; the CUDA "
            f"context adds about {_gb(CUDA_CONTEXT_BYTES)} per GPU)"
        )
    return lines


PART_NOTES = {
    "libraries": "  torch, transformers, peft, datasets, ... as `hftrain train` imports them (measured here)",
    "runtime": "  tokenizer, Trainer, thread pools, allocator slack",
    "data pipeline": "  the shuffle windows read in this process (data.shuffle_window x seq_len, int32)",
    "activations": "  saved for backward, every layer (one at a time under gradient checkpointing)",
    "logits and loss": "  micro-batch x seq_len x vocab, with the loss's working set (DPO: TRL's fused head, in tiles)",
    "reference weights": (
        "  DPO: the frozen copy of the starting weights (full fine-tuning), sharded as the weights are"
    ),
    "autocast weight copies": "  bf16 copies of the matmul weights autocast keeps until backward",
    "kept freed blocks": "  the step's smaller freed tensors, kept by the allocator for reuse",
    "evaluation logits and loss": "  evaluation batch x seq_len x vocab, with log-probabilities",
}


def format_peak_table(part: PlanPart, info: dict[str, Any], machine: Machine, libraries: float | None) -> list[str]:
    """Predicted peak per process for each strategy and fine-tuning method, at the recipe's micro-batch."""
    from hftrain.planning.fit import GPU_STRATEGIES
    from hftrain.planning.memory import predict_peak, run_shape

    methods = ("full", "lora", "qlora")
    strategies = (
        ("single",)
        if machine.processes == 1
        else GPU_STRATEGIES
        if machine.device == "cuda"
        else ("ddp", "fsdp", "zero3")
    )
    usable = machine.memory_per_process * (1 - MARGIN)
    lines = [
        f"predicted peak per process by strategy and method (micro-batch {part.training.per_device_train_batch_size}; "
        f"* = over the {usable / 1e9:,.1f} GB usable):",
        "  " + f"{'strategy':<16}" + "".join(f"{m:>12}" for m in methods),
    ]
    for strategy in strategies:
        cells = []
        for method in methods:
            variant = replace(part, finetune=part.finetune.model_copy(update={"method": method}))
            total = predict_peak(
                variant, info, run_shape(variant, machine.device, machine.processes, strategy), libraries
            ).total
            cells.append(f"{total / 1e9:>10,.2f}{'*' if total > usable else ' '}")
        lines.append("  " + f"{strategy:<16}" + "".join(f"{c:>12}" for c in cells))
    return lines


def format_fit(configured: Fit, chosen: Fit) -> list[str]:
    verdict = "fits" if configured.fits else "does NOT fit"
    lines = [
        f"as configured ({configured.shape.strategy}, micro-batch {configured.shape.micro_batch}): {verdict} "
        f"({configured.peak.total / 1e9:,.2f} GB of {configured.limit / 1e9:,.1f} GB usable per process)"
    ]
    lines.append(f"recommendation: {chosen.reason}")
    lines.append(
        "  (parallelism.fit_memory: true makes `hftrain train` take this micro-batch and gradient checkpointing)"
    )
    return lines


def format_time(
    info: dict[str, Any],
    fit: Fit,
    machine: Machine,
    peak_flops: float,
    peak_source: str,
    mfu: float,
    mfu_source: str,
    price_per_hour: float | None,
) -> list[str]:
    """Step time, the run's hours and cost from the FLOPs, a stated MFU and the device's peak."""
    seconds = step_time(info, fit, peak_flops, mfu)
    lines = [
        f"time: {seconds:,.2f} s per optimizer step = FLOPs / ({peak_flops / 1e12:,.1f} TFLOP/s {peak_source} x MFU "
        f"{mfu:.2f}, {mfu_source})"
    ]
    steps = info["max_steps"]
    if steps:
        hours = steps * seconds / 3600
        lines.append(f"run: {steps:,} steps = {hours:,.1f} hours on {machine.description}")
        if price_per_hour:
            devices = machine.processes if machine.device == "cuda" else 1
            lines.append(
                f"cost: {hours * devices:,.1f} device-hours x ${price_per_hour:,.2f} = "
                f"${hours * devices * price_per_hour:,.0f}"
            )
    return lines
