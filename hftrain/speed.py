"""Speed defaults: bf16 autocast and torch.compile, chosen per run when the recipe leaves them unset.

A recipe that sets ``training.bf16``, ``training.fp16`` or ``training.torch_compile`` keeps its choice; these
rules only fill in what it leaves open. They come from ``benchmarks/throughput.py`` (README, "Performance"):

* bf16 autocast. On a GPU with bf16 (Ampere and later) it is the standard way to train. On a CPU it pays only
  where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX) and the matmuls hold enough of the work. On
  an AMX Xeon a 4-layer / 128-wide model gained little (1.07x) with a 4k-token output head (1.3M matmul
  parameters; the quickstart): there fp32 is kept, exact and as fast. On an AVX-512 BF16 EPYC (no AMX) a
  64-wide model lost (0.83x) while a 512-wide one gained 1.78x.
  Quantized fine-tuning (qlora, lora_8bit) has its own compute dtype and is left alone.
* torch.compile fuses the many small operations around the matmuls (~1.2x here) but costs a compile at start
  (~1 minute on a CPU, several with cold caches). It is chosen only for runs long enough to win the time back
  many times over, and only where it is routinely used: full training, one process or DDP, no gradient
  checkpointing.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .recipe_schema import Recipe

BF16_CPU_MIN_MATMUL_PARAMS = 4_000_000  # parameters in matmuls (layers + output head); below it bf16 lost
COMPILE_MIN_EAGER_SECONDS = 20 * 60  # compile (~1-2 min) when the eager run would take longer than this
# Sustained training FLOP/s used to estimate a run's eager duration before it starts. Nominal, not measured:
# the same recipe on the same machine must get the same defaults however busy the machine is.
CPU_FLOPS_PER_THREAD = 40e9  # fp32; bf16 counts double (this CPU: ~90 GFLOP/s peak matmul per thread)
GPU_FLOPS = 100e12  # bf16, a datacenter GPU at a typical MFU
DTYPE_KEYS = ("bf16", "fp16")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: the CPU multiplies bf16 in hardware (else bf16 is emulated and slow)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def choose_bf16(recipe: Recipe, matmul_params: int, device: torch.device) -> tuple[bool, str]:
    if recipe.finetune.method in ("qlora", "lora_8bit"):
        return False, "quantized fine-tuning uses its own compute dtype"
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return supported, "this GPU computes in bf16" if supported else "this GPU has no bf16"
    if device.type != "cpu":
        return False, f"no rule for {device.type}"
    if not cpu_has_native_bf16():
        return False, "this CPU has no native bf16 (AVX-512 BF16 / AMX)"
    millions = f"{matmul_params / 1e6:.1f}M matmul parameters"
    if matmul_params < BF16_CPU_MIN_MATMUL_PARAMS:
        return False, f"{millions} < {BF16_CPU_MIN_MATMUL_PARAMS / 1e6:.0f}M: casts cost more than bf16 saves"
    return True, f"native bf16 CPU and {millions} >= {BF16_CPU_MIN_MATMUL_PARAMS / 1e6:.0f}M"


def choose_compile(recipe: Recipe, kwargs: dict[str, Any], strategy: str, eager_seconds: float) -> tuple[bool, str]:
    if recipe.finetune.method != "full":
        return False, "adapters: compile rarely pays for the small trainable part"
    if strategy not in ("single", "ddp"):
        return False, f"not with {strategy}"
    if kwargs.get("gradient_checkpointing"):
        return False, "not with gradient checkpointing"
    if eager_seconds < COMPILE_MIN_EAGER_SECONDS:
        return False, f"a short run (~{eager_seconds / 60:.0f} min eager): the compile would not pay back"
    return True, f"a long run (~{eager_seconds / 60:.0f} min eager): the compile pays back"


def sustained_flops(device: torch.device, bf16: bool) -> float:
    if device.type == "cuda":
        return GPU_FLOPS
    return CPU_FLOPS_PER_THREAD * torch.get_num_threads() * (2 if bf16 else 1)


def apply_defaults(recipe: Recipe, kwargs: dict[str, Any], strategy: str, matmul_params: int, flops_per_step: float,
                   device: torch.device) -> list[str]:  # fmt: skip
    """Fill in bf16 / torch_compile where the recipe is silent; returns one line per decision, for the log."""
    decisions = []
    if not any(key in kwargs for key in DTYPE_KEYS):
        kwargs["bf16"], why = choose_bf16(recipe, matmul_params, device)
        decisions.append(f"bf16={'on' if kwargs['bf16'] else 'off'} ({why})")
    if "torch_compile" not in kwargs:
        eager = kwargs["max_steps"] * flops_per_step / sustained_flops(device, bool(kwargs.get("bf16")))
        kwargs["torch_compile"], why = choose_compile(recipe, kwargs, strategy, eager)
        decisions.append(f"torch_compile={'on' if kwargs['torch_compile'] else 'off'} ({why})")
    return decisions
