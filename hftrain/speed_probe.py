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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

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


def _key(shape: ProbeShape, device: torch.device) -> str:
    return f"v{CACHE_VERSION}|{machine_id(device)}|{json.dumps(asdict(shape), sort_keys=True)}"


def measure(shape: ProbeShape, device: torch.device) -> Measurement:
    """The cached measurement for this machine and shape, else a fresh one (then cached)."""
    key = _key(shape, device)
    cache = _read_cache()
    if key in cache:
        return Measurement(cache[key], str(device), cached=True)
    seconds = {dtype: _time_dtype(shape, device, dtype) for dtype in candidates(device)}
    cache[key] = seconds
    _write_cache(cache)
    return Measurement(seconds, str(device))


def compile_is_warm(shape: ProbeShape, device: torch.device) -> bool:
    """This machine compiled this shape before (hftrain chose compile for it) and inductor's cache is still there."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        kept = Path(cache_dir()).is_dir() and any(Path(cache_dir()).iterdir())
    except (ImportError, OSError):
        kept = False
    return kept and bool(_read_cache().get(_key(shape, device) + "|compiled"))


def mark_compiled(shape: ProbeShape, device: torch.device) -> None:
    cache = _read_cache()
    cache[_key(shape, device) + "|compiled"] = True
    _write_cache(cache)


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


PROBE_TOKENS = 512  # rows of the probe's matmuls; their time scales linearly to the run's micro-batch
PROBE_VOCAB = 8192  # columns of the probe's head; its time scales linearly to the vocabulary
TOO_SLOW = 4.0  # a dtype this many times slower than fp32 on a small matmul is not probed further


def _time_dtype(shape: ProbeShape, device: torch.device, dtype: str) -> float:
    """Seconds for the model's matmuls in one training step (all layers + head, forward and backward), from a
    probe of at most PROBE_TOKENS x PROBE_VOCAB scaled up: the cost stays about a second whatever the model."""
    if dtype != "fp32":
        slowdown = _small_matmul_seconds(device, dtype) / _small_matmul_seconds(device, "fp32")
        if slowdown > TOO_SLOW:  # emulated (e.g. bf16 without AVX-512 BF16 / AMX): 10-50x slower
            return _time_dtype(shape, device, "fp32") * slowdown
    tokens, vocab = min(shape.tokens, PROBE_TOKENS), min(shape.vocab, PROBE_VOCAB)
    d, i = shape.hidden, shape.intermediate
    layer = torch.nn.ModuleList([torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), torch.nn.Linear(d, i), torch.nn.Linear(i, d)])
    head = torch.nn.ModuleList([torch.nn.Linear(d, vocab, bias=False)])
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    seconds = {}
    with _tf32(dtype == "tf32"):
        for name, modules in (("layer", layer.to(device)), ("head", head.to(device))):
            seconds[name] = _time_passes(modules, x, device, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype))
    scale = shape.tokens / tokens
    return scale * (shape.layers * seconds["layer"] + seconds["head"] * shape.vocab / vocab)


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _small_matmul_seconds(device: torch.device, dtype: str) -> float:
    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    a, b = a.to(cast), b.to(cast)
    best = float("inf")
    with _tf32(dtype == "tf32"):
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _time_passes(modules: torch.nn.ModuleList, x: torch.Tensor, device: torch.device, autocast: torch.dtype | None) -> float:
    """Median seconds of one forward + backward pass (see _pass), after one warm-up pass."""
    _pass(modules, x, device, autocast)  # warm-up: kernels chosen, memory allocated
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < PROBE_SECONDS and len(times) < 50):
        begin = time.perf_counter()
        _pass(modules, x, device, autocast)
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def _pass(modules: torch.nn.ModuleList, x: torch.Tensor, device: torch.device, autocast: torch.dtype | None) -> None:
    """Forward + backward through one layer's linears (query_key_value, dense, the MLP pair) or the head."""
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        if len(modules) == 4:
            qkv, dense, up, down = modules
            out = down(up(dense(qkv(x)[:, : x.shape[1]])))
        else:
            out = modules[0](x)
    out.float().sum().backward()
    modules.zero_grad(set_to_none=True)
    x.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
