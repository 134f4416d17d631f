"""What the device at hand can do, measured rather than read off a spec sheet or CPU flags."""

from __future__ import annotations

import time

import torch


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
