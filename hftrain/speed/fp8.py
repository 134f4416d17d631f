"""FP8 training of the linear layers (``speed.fp8: tensorwise | rowwise``) through torchao's float8 workflow.

torchao's ``convert_to_float8_training`` swaps chosen ``nn.Linear`` modules for its ``Float8Linear``, whose matmuls
cast their inputs, weights and gradients to FP8 with dynamic scales (tensorwise: one scale per tensor, cuBLAS, the
fastest; rowwise: one per row, closer to bf16). The high-precision weight stays an ordinary parameter under the
same name, so the state dict, checkpoints and the final model are transformers' own bf16/fp32 safetensors.

Which layers convert (model/float8.py's ``layer_choice``, pure: it reads module names and shapes, so it runs on the
meta device and needs no torchao): every Linear of the transformer blocks but those of the first and last block,
which stay in high precision with the output head, and any whose in/out features are not multiples of 16 (an FP8
GEMM needs them).
torchao's example and torchtitan leave out the head only; accelerate's torchao path also keeps the first Linear
("for stability": FP8 ends can stop a model converging) and Megatron-LM's ``first_last_layers_bf16`` one block at
each end. A 12-block pythia-160m keeps 10 of its 12 blocks in FP8, so the ends cost a sixth of the gain.

Where it pays: the casts and scale reductions cost memory traffic the FP8 matmul must win back, so the gain grows
with the GEMMs. Published: Llama-3-8B (hidden 4,096) +25% tensorwise (torchao, 8 H100s), GPT-1.5B only +3.6%, and
a (1024, 2048, 1024) GEMM at 0.80x (torchao's H100 table); below ~2,048 hidden FP8 may be slower than bf16
(``expectation``). It needs torch.compile to fuse the casts (eager FP8 is slower than bf16), so a recipe that leaves
training.torch_compile unset gets it on (``compile_for``) and one that sets it false is refused.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from hftrain.errors import HftrainError
from hftrain.model.float8 import ALIGN, converted, layer_choice
from hftrain.model.shape import ModelShape
from hftrain.speed.defaults import DeviceFacts

KEY = "speed.fp8"
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x, 12.x)
PAYS_FROM_HIDDEN = 4096  # Llama-3-8B's width, where torchao measured +25% (tensorwise)
MAY_LOSE_BELOW_HIDDEN = 2048  # GPT-1.5B gained 3.6%; torchao's (1024, 2048, 1024) GEMM ran at 0.80x
PUBLISHED = "Llama-3-8B +25% tensorwise (torchao, 8 H100s), GPT-1.5B +3.6%"


def summary(shape: ModelShape) -> dict[str, int]:
    """The counts `describe` reads (kept by `hftrain plan`'s estimates): linear layers, converted, blocks, unaligned."""
    choice = layer_choice(shape)
    unaligned = sum(1 for why in choice.values() if why and "multiple" in why)
    return {
        "linear": len(choice),
        "converted": sum(why is None for why in choice.values()),
        "blocks": len(shape.block_params),
        "unaligned": unaligned,
    }


def describe(counts: dict[str, int], fp8: str) -> str:
    """One line for the speed plan and `hftrain plan`: how many linear layers convert, and which stay."""
    odd = f", {counts['unaligned']} with dims not multiples of {ALIGN}" if counts["unaligned"] else ""
    return (
        f"fp8 ({fp8}, torchao): {counts['converted']} of {counts['linear']} linear layers in FP8 matmuls, in blocks "
        f"1-{counts['blocks'] - 2} of 0-{counts['blocks'] - 1}; the output "
        f"head, the first and last block{odd} stay in high precision"
    )


def note(shape: ModelShape, fp8: str) -> str:
    """`describe` for a model (the run's speed plan)."""
    return describe(summary(shape), fp8)


def expectation(hidden: int) -> str:
    """What the published measurements say a model of this width may gain."""
    if hidden >= PAYS_FROM_HIDDEN:
        verdict = f"hidden {hidden:,}: wide enough for FP8 to pay"
    elif hidden >= MAY_LOSE_BELOW_HIDDEN:
        verdict = f"hidden {hidden:,}: a few percent at best"
    else:
        verdict = (
            f"hidden {hidden:,}: FP8 may be slower than bf16 (below ~{MAY_LOSE_BELOW_HIDDEN:,} its casts and scales "
            "cost more than the small matmuls save)"
        )
    return f"{verdict}; published: {PUBLISHED}; FP8 pays from hidden ~{PAYS_FROM_HIDDEN:,}"


def compile_for(fp8: str | None, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """torch.compile on for an FP8 run whose recipe leaves training.torch_compile unset (the values to set and the
    speed plan's reason); nothing otherwise (a recipe's false is refused by `check`)."""
    if not fp8 or "torch_compile" in kwargs:
        return {}, []
    return {"torch_compile": True}, [f"torch_compile=on ({KEY}: {fp8} needs it to fuse the FP8 casts)"]


def check(
    fp8: str | None,
    device: DeviceFacts,
    card: str,
    recipe_kwargs: dict[str, Any],
    method: str,
    strategy: str,
    shape: ModelShape | None = None,
    installed: bool | None = None,
) -> None:
    """Refuse, in one line naming speed.fp8, an FP8 run that cannot train: on a CPU, on a card without FP8 (`card`:
    its name), with training.torch_compile: false in `recipe_kwargs`, with adapters or quantized fine-tuning, under
    DeepSpeed ZeRO-3, on a model (its `shape`) with no layer to convert, or without torchao (`installed`:
    found by import, unless given)."""
    if not fp8:
        return
    what = f"{KEY}: {fp8}"
    if device.type != "cuda":
        raise HftrainError(
            f"{what} needs a CUDA GPU with FP8 (compute capability 8.9 or newer: Ada, Hopper, Blackwell), but this run "
            f"trains on the {device.type.upper()}; remove {KEY} (or set it to null) to train here."
        )
    if device.capability is None or tuple(device.capability) < FP8_CAPABILITY:
        raise HftrainError(
            f"{what} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell), but "
            f"{card or 'this GPU'} has {device.label}; remove {KEY} (bf16 is this card's fastest precision)."
        )
    if recipe_kwargs.get("torch_compile") is False:
        raise HftrainError(
            f"{what} needs torch.compile to fuse its casts (eager FP8 is slower than bf16), but the recipe sets "
            f"training.torch_compile: false; remove that key (FP8 turns compile on) or remove {KEY}."
        )
    if method != "full":
        raise HftrainError(
            f"{what} converts the trained linear layers of full training, not finetune.method: {method} (peft's "
            f"adapters and bitsandbytes' quantized layers wrap the same nn.Linear modules torchao replaces); use "
            f"finetune.method: full or remove {KEY}."
        )
    if strategy == "zero3":
        raise HftrainError(
            f"{what} with parallelism.strategy=zero3: not supported; "
            "torchao documents its FP8 layers with FSDP2 and DDP, "
            f"not with DeepSpeed's weights partitioned as the model is built (zero.Init); use --accelerate-config fsdp "
            f"(or ddp), or remove {KEY}."
        )
    if shape is not None and not converted(shape):
        raise HftrainError(
            f"{what}: no linear layer of this model converts (the output head, the first and last block and dims not "
            f"multiples of {ALIGN} stay in high precision; it has {len(shape.block_params)} blocks); remove {KEY}."
        )
    if not (installed if installed is not None else importlib.util.find_spec("torchao") is not None):
        raise HftrainError(
            f"{what} needs torchao, which is not installed: pip install 'hftrain[fp8]' (or remove {KEY})."
        )


def check_here(
    fp8: str | None, device: torch.device, recipe_kwargs: dict[str, Any], method: str, strategy: str, shape: ModelShape
) -> None:
    """`check` for the device this process trains on (its compute capability and name read from CUDA)."""
    if fp8:
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        check(fp8, DeviceFacts.of(device), card, recipe_kwargs, method, strategy, shape)
