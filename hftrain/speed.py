"""Speed defaults: torch.compile and bf16 autocast, chosen per run when the recipe leaves them unset.

A recipe that sets ``training.torch_compile``, ``training.bf16`` or ``training.fp16`` keeps its choice; these
rules only fill in what it leaves open. They come from ``benchmarks/throughput.py`` (README, "Performance"),
measured on a 2-core AMX Xeon against a plain Trainer script (fp32, eager):

    shape              bf16 eager   bf16 + compile   fp32 + compile
    small (4 x 128)    0.88x        1.17-1.35x       1.06x
    medium (6 x 384)   1.44x        1.31-1.81x
    large (8 x 512)                 1.58-2.14x

* torch.compile fuses the small operations around the matmuls, including the casts bf16 needs; it costs a
  compile at start (~35-40 s here with warm caches, longer cold). It is chosen when the run is long enough
  to win that back several times (an eager estimate of at least COMPILE_MIN_EAGER_SECONDS), and only where
  it is routinely used: full training, one process or DDP, no gradient checkpointing.
* bf16 autocast. On a GPU with bf16 (Ampere and later) it is the standard way to train. On a CPU it needs
  native bf16 (AVX-512 BF16 or AMX) and matmuls that hold the work (BF16_CPU_MIN_MATMUL_PARAMS); then it is
  on when compiled, or eager from hidden size BF16_CPU_EAGER_MIN_HIDDEN (narrower eager models lose to the
  casts: 0.88x above; on an AVX-512 BF16 EPYC a 64-wide model 0.83x, a 512-wide one 1.78x). Small models
  (the quickstart: 1.3M matmul parameters, 1.07x) keep exact fp32. Quantized fine-tuning (qlora,
  lora_8bit) has its own compute dtype and is left alone.
* DDP without ``find_unused_parameters``: the Trainer turns it on for any model without gradient
  checkpointing, which costs an extra pass over the autograd graph every step (and a warning). Every
  GPT-NeoX parameter that requires a gradient gets one at every step, full training or adapters alike.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .recipe_schema import Recipe

COMPILE_MIN_EAGER_SECONDS = 5 * 60  # compile when the eager run would take longer than this
BF16_CPU_MIN_MATMUL_PARAMS = 4_000_000  # parameters in matmuls (layers + output head)
BF16_CPU_EAGER_MIN_HIDDEN = 256
# Sustained fp32 training FLOP/s, to estimate a run's eager duration before it starts. Nominal, not measured:
# the same recipe on the same machine must get the same defaults however busy the machine is.
CPU_FLOPS_PER_THREAD = 40e9  # the small shape above ran at ~41 GFLOP/s per thread
GPU_FLOPS = 100e12  # a datacenter GPU at a typical MFU


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: the CPU multiplies bf16 in hardware (else bf16 is emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def choose_compile(recipe: Recipe, kwargs: dict[str, Any], strategy: str, eager_seconds: float) -> tuple[bool, str]:
    if recipe.finetune.method != "full":
        return False, "adapters: compile rarely pays for the small trainable part"
    if strategy not in ("single", "ddp"):
        return False, f"not with {strategy}"
    if kwargs.get("gradient_checkpointing"):
        return False, "not with gradient checkpointing"
    minutes = f"~{eager_seconds / 60:.0f} min eager"
    if eager_seconds < COMPILE_MIN_EAGER_SECONDS:
        return False, f"a short run ({minutes}): the compile would not pay back"
    return True, f"a long run ({minutes}): the compile pays back"


def choose_bf16(recipe: Recipe, model: dict[str, int], compiled: bool, device: torch.device) -> tuple[bool, str]:
    """`model`: {"matmul_params", "hidden_size"}."""
    if recipe.finetune.method in ("qlora", "lora_8bit"):
        return False, "quantized fine-tuning uses its own compute dtype"
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return supported, "this GPU computes in bf16" if supported else "this GPU has no bf16"
    if device.type != "cpu":
        return False, f"no rule for {device.type}"
    if not cpu_has_native_bf16():
        return False, "this CPU has no native bf16 (AVX-512 BF16 / AMX)"
    millions = f"{model['matmul_params'] / 1e6:.1f}M matmul parameters"
    if model["matmul_params"] < BF16_CPU_MIN_MATMUL_PARAMS:
        return False, f"{millions} < {BF16_CPU_MIN_MATMUL_PARAMS / 1e6:.0f}M: too little work for bf16 to pay"
    if compiled:
        return True, f"native bf16 CPU, {millions}, compiled"
    if model["hidden_size"] < BF16_CPU_EAGER_MIN_HIDDEN:
        return False, f"eager and hidden size {model['hidden_size']} < {BF16_CPU_EAGER_MIN_HIDDEN}: the casts cost more than bf16 saves"
    return True, f"native bf16 CPU, {millions}, hidden size {model['hidden_size']}"


def sustained_flops(device: torch.device) -> float:
    return GPU_FLOPS if device.type == "cuda" else CPU_FLOPS_PER_THREAD * torch.get_num_threads()


def apply_defaults(recipe: Recipe, kwargs: dict[str, Any], strategy: str, model: dict[str, int], flops_per_step: float,
                   device: torch.device) -> list[str]:  # fmt: skip
    """Fill in torch_compile / bf16 where the recipe is silent; returns one line per decision, for the log.
    `model`: {"matmul_params", "hidden_size"}; `flops_per_step`: training FLOPs of one step on one device."""
    decisions = []
    kwargs.setdefault("ddp_find_unused_parameters", False)
    if "torch_compile" not in kwargs:
        eager = kwargs["max_steps"] * flops_per_step / sustained_flops(device)
        kwargs["torch_compile"], why = choose_compile(recipe, kwargs, strategy, eager)
        decisions.append(f"torch_compile={'on' if kwargs['torch_compile'] else 'off'} ({why})")
    if not any(key in kwargs for key in ("bf16", "fp16")):
        kwargs["bf16"], why = choose_bf16(recipe, model, bool(kwargs["torch_compile"]), device)
        decisions.append(f"bf16={'on' if kwargs['bf16'] else 'off'} ({why})")
    return decisions
