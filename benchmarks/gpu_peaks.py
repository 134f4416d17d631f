"""GPU bf16 peaks for MFU: the spec sheet's dense bf16 Tensor Core TFLOPS, matched on torch.cuda.get_device_name(),
and a measured matmul peak (hftrain.speed.hardware.measure_peak_flops). An unknown GPU gets the measured peak only."""

from __future__ import annotations

import re
from typing import Any

# (pattern on the device name, dense bf16 TFLOPS, which card). Order matters: the first match wins.
SPEC_BF16_TFLOPS: list[tuple[str, float, str]] = [
    (r"H200", 989.4, "H200"),
    (r"H100.*NVL", 0.0, "H100 NVL (not in the table)"),
    (r"H100.*PCIe", 756.0, "H100 PCIe"),
    (r"H100", 989.4, "H100 SXM"),
    (r"A100", 312.0, "A100"),
    (r"\bL4\b", 121.0, "L4"),
]


def spec_bf16_tflops(device_name: str) -> tuple[float | None, str | None]:
    """(dense bf16 TFLOPS, the card it matched) from the spec sheet, or (None, None) for an unknown GPU."""
    for pattern, tflops, card in SPEC_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return (tflops or None, card if tflops else None)
    return None, None


def gpu_peaks(seconds: float = 1.0) -> dict[str, Any]:
    """The current CUDA device's name, spec-sheet and measured bf16 peaks (FLOP/s)."""
    import torch

    from hftrain.speed.hardware import measure_peak_flops

    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    spec, card = spec_bf16_tflops(name)
    measured = measure_peak_flops(device, torch.bfloat16, seconds)
    return {"device_name": name, "spec_card": card, "spec_bf16_flops": spec * 1e12 if spec else None, "measured_bf16_flops": measured}


def mfu(tokens_per_s: float, flops_per_token: float, peaks: dict[str, Any]) -> dict[str, float | None]:
    """MFU against the spec-sheet peak (None for an unknown GPU) and against the measured matmul peak."""
    achieved = tokens_per_s * flops_per_token
    spec = peaks.get("spec_bf16_flops")
    return {"mfu_spec": achieved / spec if spec else None, "mfu_measured": achieved / peaks["measured_bf16_flops"]}
