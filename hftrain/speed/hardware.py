"""What the device at hand can do, measured rather than read off a spec sheet or CPU flags."""

from __future__ import annotations

import hashlib
import platform
import re
import time
from pathlib import Path

import torch

from hftrain import _cache

PEAKS_FILE = "matmul-peaks.json"


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


def peak_flops_here(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(measure_peak_flops, how it was had) for this machine, kept in hftrain's cache under the processor (or GPU),
    the thread count and torch's version: `hftrain plan` answers without its half-second burst after the first."""
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    key = f"{hardware}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"
    kept = _cache.read_json(PEAKS_FILE)
    kept = kept if isinstance(kept, dict) else {}
    if isinstance(kept.get(key), dict) and kept[key].get("flops", 0) > 0:
        return float(
            kept[key]["flops"]
        ), f"measured on this machine on {kept[key]['date']} ({_cache.cache_dir() / PEAKS_FILE})"
    flops = measure_peak_flops(device, dtype)
    _cache.write_json(PEAKS_FILE, {**kept, key: {"flops": flops, "date": time.strftime("%Y-%m-%d")}}, indent=1)
    return flops, "measured here now"


def cpu_description() -> str:
    """The processor as its numbers depend on it: its model name and a digest of its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = " ".join(fields.get("model name\t", fields.get("model name", platform.machine())).split())
    flags = hashlib.sha256(fields.get("flags\t", fields.get("flags", "")).encode()).hexdigest()[:12]
    return f"{name} flags:{flags}"


# (pattern on the device name, dense bf16 TFLOPS, which card), from NVIDIA's data sheets (dense, no sparsity).
# Order matters: the first match wins.
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
