"""Measure, on the device a run uses, what each speed lever would give at the model's own shapes.

Why measure: the same flags mean opposite things on different machines. A 2-core Xeon with AMX ran bf16
matmuls at 4x fp32; another Xeon, with AVX-512 BF16 but no AMX, at half of fp32. And a fast matmul is not a
fast step: on an AMD EPYC whose bf16 matmul peak is 2.2x fp32, a 4-layer, 128-wide model with a 50k
vocabulary trained slower in bf16 (0.94x), because the casts of its big head and the fp32 loss and optimizer
ate the gain. So the probe times the real GPT-NeoX model's forward, loss and backward at the run's width,
context and micro-batch, in fp32 and under each candidate autocast dtype, and adds the optimizer step.

The dtypes take turns in two rounds (fp32, bf16, then bf16, fp32) and each keeps its faster round: timed once
each, one after the other, a busy moment on a shared machine had cached bf16 at 1.15x fp32 on a Xeon where bf16
runs at half of fp32, and every later run of that shape trained at 0.79x the plain Trainer (benchmarks/
throughput.py, small shape). It takes 2-24 s on a 2-core CPU (more for a wide model with a long context); the result is
cached per machine, library versions and shape in ``~/.cache/hftrain/speed.json`` (HFTRAIN_CACHE_DIR moves it), so later
runs of the same shape decide at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hftrain import _cache
from hftrain.model import fused_loss
from hftrain.speed.hardware import cpu_description

# 5: dtypes timed in alternating rounds (a busy moment had flipped a cached choice); 4:
# glibc malloc thresholds pinned on CPUs (_compat.keep_freed_memory); 3: the chunked
# loss on CPUs (fused_loss.py); 2: whole-step estimates (1 timed the matmuls only)
CACHE_VERSION = 5
PROBE_SECONDS = 0.25  # per candidate dtype and round, after one warm-up pass
PROBE_BUDGET_S = 60.0  # a probe expected to take longer is skipped (defaults.decide_here says so)


@dataclass(frozen=True)
class ProbeShape:
    """What decides a training step's time: the model's shape, the micro-batch and the trained parameters."""

    tokens: int  # tokens in one micro-batch (per_device_train_batch_size x seq_len)
    seq: int  # the context each sequence has (attention's cost grows with it)
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    layers: int
    parameters: int  # trainable parameters: what the optimizer steps over
    options: tuple[tuple[str, Any], ...] = ()  # the rest of the GPTNeoXConfig that changes a layer's work


@dataclass(frozen=True)
class Measurement:
    """Estimated seconds of one training step (forward, loss, backward, optimizer) per dtype; and where from."""

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
        hardware = cpu_description()
    return (
        f"{hardware}|threads={torch.get_num_threads()}|torch={torch.__version__}|"
        f"transformers={transformers.__version__}"
    )


def candidates(device: torch.device) -> list[str]:
    if device.type == "cuda":
        out = ["fp32", "tf32", "fp16"]
        return out + ["bf16"] if torch.cuda.is_bf16_supported() else out
    return ["fp32", "bf16"]


CACHE_NAME = "speed.json"  # in hftrain's cache (hftrain/_cache.py)


def cache_file() -> Path:
    return _cache.cache_dir() / CACHE_NAME


def _key(shape: ProbeShape, device: torch.device) -> str:
    return f"v{CACHE_VERSION}|{machine_id(device)}|{json.dumps(asdict(shape), sort_keys=True)}"


def measure(shape: ProbeShape, device: torch.device) -> Measurement:
    """The cached measurement for this machine and shape, else a fresh one (then cached)."""
    key = _key(shape, device)
    cache = _read_cache()
    if key in cache:
        return Measurement(cache[key], str(device), cached=True)
    from hftrain.progress import phase

    with phase(
        f"measuring this {device.type.upper()}'s step speed in {' and '.join(candidates(device))} "
        f"(once per machine and model shape, cached in {cache_file()})"
    ):
        seconds = _time_dtypes(shape, device)
    cache[key] = seconds
    _write_cache(cache)
    return Measurement(seconds, str(device))


def is_cached(shape: ProbeShape, device: torch.device) -> bool:
    return _key(shape, device) in _read_cache()


def expected_seconds(shape: ProbeShape, device: torch.device) -> float:
    """About how long a fresh probe of `shape` takes here: its forward and backward passes (a warm-up and at least
    three timed, per model, dtype and round) at the FLOPs of the probed tokens, at the speed of a small fp32 matmul
    (below the device's peak: the estimate errs long). A wide model with a long context on a CPU takes minutes."""
    tokens = max(1, min(shape.tokens, PROBE_TOKENS.get(device.type, 1024)) // shape.seq) * shape.seq
    layer = 4 * shape.hidden**2 + 2 * shape.hidden * shape.intermediate
    flops = 6 * tokens * (shape.vocab * shape.hidden + layer + 2 * shape.seq * shape.hidden)  # head, a layer, attention
    rate = 2 * 256**3 / _small_matmul_seconds(device, "fp32")
    return 4 * 2 * len(candidates(device)) * flops / rate


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
    data = _cache.read_json(CACHE_NAME)
    return data if isinstance(data, dict) else {}


def _write_cache(cache: dict[str, Any]) -> None:
    _cache.write_json(CACHE_NAME, cache, indent=1)


# at most this many tokens (whole sequences) per probe pass, scaled linearly to the run's micro-batch: on a CPU
# enough for the logits to outgrow the caches at a real vocabulary, as in training; a GPU needs more to fill
PROBE_TOKENS = {"cpu": 1024, "cuda": 16384}
PROBE_PARAMETERS = 2_000_000  # AdamW is timed on this many parameters and scaled to the model's count
TOO_SLOW = 4.0  # a dtype this many times slower than fp32 on a small matmul is not probed further


def _time_dtypes(shape: ProbeShape, device: torch.device) -> dict[str, float]:
    """Seconds of one training step in fp32 and each candidate dtype: the embeddings, head and loss (a GPT-NeoX
    with no layer, at the run's full vocabulary) plus the run's layer count times one GPT-NeoX layer, each forward
    and backward under the dtype's autocast as training runs them (casts, norms, softmax, attention and the fp32
    loss included), on the run's micro-batch (at most PROBE_TOKENS, scaled), plus the optimizer step, the same in
    every dtype. The two models and the optimizer timing are made once and shared by the dtypes.

    The vocabulary is never scaled down: a 4-layer, 128-wide model probed at an 8k vocabulary showed bf16 1.2x
    faster; at its real 50k one, where the logits and their casts outgrow the caches, 0.9-1.0x, as training ran."""
    head_model = _probe_model(shape, 0, shape.vocab, device)
    if fused_loss.applies(device, compiled=False):  # the probe times eager steps, with the loss they use
        fused_loss.use(head_model)
    layer_model = _probe_model(shape, 1, 8, device).gpt_neox  # fed embeddings: its own (tiny) vocabulary is unused
    optimizer = _optimizer_seconds(shape.parameters, device)
    slowdown = {
        d: _small_matmul_seconds(device, d) / _small_matmul_seconds(device, "fp32") if d != "fp32" else 1.0
        for d in candidates(device)
    }
    # emulated (e.g. bf16 without AVX-512 BF16 / AMX): not probed further
    probed = [d for d in slowdown if slowdown[d] <= TOO_SLOW]
    compute = {d: float("inf") for d in probed}
    for order in (probed, probed[::-1]):  # the dtypes take turns, twice, in opposite orders: a busy moment of a shared
        for dtype in order:  # machine lands on each, and the faster round of each counts (it is cached)
            compute[dtype] = min(compute[dtype], _compute_seconds(shape, device, dtype, head_model, layer_model))
    seconds = {d: compute[d] + optimizer for d in probed}
    seconds.update({d: seconds["fp32"] * slowdown[d] for d in slowdown if d not in compute})  # 10-50x slower
    return {d: seconds[d] for d in slowdown}


def _compute_seconds(shape: ProbeShape, device: torch.device, dtype: str, head_model: Any, layer_model: Any) -> float:
    """Forward + backward seconds of the run's micro-batch in `dtype`; fewer sequences when memory runs short."""
    sequences = max(1, min(shape.tokens, PROBE_TOKENS.get(device.type, 1024)) // shape.seq)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    while True:
        try:
            ids = torch.randint(shape.vocab, (sequences, shape.seq), device=device)
            embeds = torch.randn(sequences, shape.seq, shape.hidden, device=device, requires_grad=True)
            with _tf32(dtype == "tf32"):
                head = _median_seconds(lambda: _train_pass(head_model, device, autocast, input_ids=ids, labels=ids))
                layer = _median_seconds(lambda: _train_pass(layer_model, device, autocast, inputs_embeds=embeds))
            return shape.tokens / ids.numel() * (shape.layers * layer + head)
        except torch.OutOfMemoryError:
            if sequences == 1:
                raise  # decide_here falls back without a measurement
            sequences //= 2  # a GPU already holding other work: fewer sequences, scaled up the same way
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _probe_model(shape: ProbeShape, layers: int, vocab: int, device: torch.device) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.seq,
        **dict(shape.options),
    )
    with torch.device(device):
        return GPTNeoXForCausalLM(config).train()


def _train_pass(
    model: torch.nn.Module, device: torch.device, autocast: torch.dtype | None, **inputs: torch.Tensor
) -> None:
    """One forward + backward of `model`: its loss, or (a bare layer stack) the sum of its output."""
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = model(**inputs)
    if autocast is not None and getattr(out, "logits", None) is not None:
        out.logits.float()  # accelerate hands the outputs back in fp32 (convert_outputs_to_fp32): one more cast
    loss = out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.float().sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    for tensor in inputs.values():
        tensor.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer_seconds(parameters: int, device: torch.device) -> float:
    """Seconds of gradient clipping and one AdamW step over `parameters` fp32 weights (timed on at most
    PROBE_PARAMETERS, scaled)."""
    count = max(1, min(parameters, PROBE_PARAMETERS))
    weights = [torch.nn.Parameter(torch.zeros(count // 4 + 1, device=device)) for _ in range(4)]
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer = torch.optim.AdamW(weights, lr=1e-4)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _median_seconds(step) * parameters / count


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


def _median_seconds(work: Callable[[], None]) -> float:
    """Median seconds of `work`, after one warm-up call (kernels chosen, memory allocated): at least 3 calls,
    more while PROBE_SECONDS last."""
    work()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < PROBE_SECONDS and len(times) < 50):
        begin = time.perf_counter()
        work()
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]
