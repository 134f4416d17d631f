"""GPU bf16 peaks for MFU: the spec sheet's dense bf16 Tensor Core TFLOPS, matched on torch.cuda.get_device_name(),
and a measured matmul peak (hftrain.speed.hardware.measure_peak_flops). An unknown GPU gets the measured peak only."""

from __future__ import annotations

from typing import Any

# the table lives with the library (`hftrain plan` uses it); imported here for the benchmarks that read it
from hftrain.speed.hardware import SPEC_BF16_TFLOPS, spec_bf16_tflops  # noqa: F401


def gpu_peaks(seconds: float = 1.0) -> dict[str, Any]:
    """The current CUDA device's name, spec-sheet and measured bf16 peaks (FLOP/s)."""
    import torch

    from hftrain.speed.hardware import measure_peak_flops

    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    spec, card = spec_bf16_tflops(name)
    measured = measure_peak_flops(device, torch.bfloat16, seconds)
    return {
        "device_name": name,
        "spec_card": card,
        "spec_bf16_flops": spec * 1e12 if spec else None,
        "measured_bf16_flops": measured,
    }


def mfu(tokens_per_s: float, flops_per_token: float, peaks: dict[str, Any]) -> dict[str, float | None]:
    """MFU against the spec-sheet peak (None for an unknown GPU) and against the measured matmul peak."""
    achieved = tokens_per_s * flops_per_token
    spec = peaks.get("spec_bf16_flops")
    return {"mfu_spec": achieved / spec if spec else None, "mfu_measured": achieved / peaks["measured_bf16_flops"]}
