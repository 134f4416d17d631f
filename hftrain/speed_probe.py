"""Measure, on the device a run uses, what each speed lever would give at the model's own shapes.

Why measure: the same flags mean opposite things on different machines. A 2-core Xeon with AMX ran bf16
matmuls at 4x fp32; another Xeon, with AVX-512 BF16 but no AMX, at half of fp32; a small model loses to the
casts even where bf16 is fast. So the probe times one GPT-NeoX layer's linear layers (query_key_value, dense,
the MLP pair) and the output head, forward and backward, on a micro-batch of the run's own size, in fp32 and
under each candidate autocast dtype (casts included, as training pays them).

It takes about a second; the result is cached per machine, library versions and shape in
``~/.cache/hftrain/speed.json`` (HFTRAIN_CACHE_DIR moves it), so later runs of the same shape decide at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CACHE_VERSION = 1
PROBE_SECONDS = 0.25  # per candidate dtype, after one warm-up pass


@dataclass(frozen=True)
class ProbeShape:
    tokens: int  # tokens in one micro-batch (per_device_train_batch_size x seq_len)
    hidden: int
    intermediate: int
    vocab: int
    layers: int


@dataclass(frozen=True)
class Measurement:
    """Seconds per training step of the model's matmuls (forward + backward), per dtype; and where from."""

    seconds: dict[str, float]  # "fp32", "bf16", "fp16" (GPU), "tf32" (GPU)
    device: str
    cached: bool = False

    def speedup(self, dtype: str) -> float:
        """fp32 time / `dtype` time: above 1, the dtype is faster at this shape."""
        return self.seconds["fp32"] / self.seconds[dtype] if dtype in self.seconds else 0.0


def machine_id(device: torch.device) -> str:
    """What decides the numbers: the processor (model name and flags) or the GPU, and the library versions."""
    import transformers

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = _cpu_description()
    return f"{hardware}|threads={torch.get_num_threads()}|torch={torch.__version__}|transformers={transformers.__version__}"


def _cpu_description() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = " ".join(fields.get("model name\t", fields.get("model name", platform.machine())).split())
    flags = hashlib.sha256(fields.get("flags\t", fields.get("flags", "")).encode()).hexdigest()[:12]
    return f"{name} flags:{flags}"


def candidates(device: torch.device) -> list[str]:
    if device.type == "cuda":
        out = ["fp32", "tf32", "fp16"]
        return out + ["bf16"] if torch.cuda.is_bf16_supported() else out
    return ["fp32", "bf16"]


def cache_file() -> Path:
    root = os.environ.get("HFTRAIN_CACHE_DIR") or Path.home() / ".cache" / "hftrain"
    return Path(root) / "speed.json"


def measure(shape: ProbeShape, device: torch.device) -> Measurement:
    """The cached measurement for this machine and shape, else a fresh one (then cached)."""
    key = f"v{CACHE_VERSION}|{machine_id(device)}|{json.dumps(asdict(shape), sort_keys=True)}"
    cache = _read_cache()
    if key in cache:
        return Measurement(cache[key], str(device), cached=True)
    seconds = {dtype: _time_dtype(shape, device, dtype) for dtype in candidates(device)}
    cache[key] = seconds
    _write_cache(cache)
    return Measurement(seconds, str(device))


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, Any]) -> None:
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(cache, indent=1), encoding="utf-8")
        os.replace(partial, path)  # concurrent runs never read half a file
    except OSError:
        pass  # a read-only home: measure again next time


def _time_dtype(shape: ProbeShape, device: torch.device, dtype: str) -> float:
    """Seconds for the model's matmuls in one training step (all layers + head, forward and backward)."""
    torch.manual_seed(0)
    d, i = shape.hidden, shape.intermediate
    layer = [torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), torch.nn.Linear(d, i), torch.nn.Linear(i, d)]
    head = torch.nn.Linear(d, shape.vocab, bias=False)
    modules = torch.nn.ModuleList([*layer, head]).to(device)
    x = torch.randn(shape.tokens, d, device=device, requires_grad=True)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        _pass(modules, x, device, autocast)  # warm-up: kernels chosen, memory allocated
        start, runs = time.perf_counter(), 0
        while runs < 2 or time.perf_counter() - start < PROBE_SECONDS:
            _pass(modules, x, device, autocast)
            runs += 1
        layer_and_head = (time.perf_counter() - start) / runs
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    head_share = _head_share(shape)
    return layer_and_head * ((1 - head_share) * shape.layers + head_share)


def _head_share(shape: ProbeShape) -> float:
    """The head's share of one probe pass's FLOPs: the layer part is then scaled to all layers."""
    d, i = shape.hidden, shape.intermediate
    layer = 3 * d * d + d * d + 2 * d * i
    return shape.vocab * d / (layer + shape.vocab * d)


def _pass(modules: torch.nn.ModuleList, x: torch.Tensor, device: torch.device, autocast: torch.dtype | None) -> None:
    qkv, dense, up, down, head = modules
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        h = qkv(x)[:, : x.shape[1]]
        h = dense(h)
        h = down(up(h))
        out = head(h)
    out.float().sum().backward()
    modules.zero_grad(set_to_none=True)
    x.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
