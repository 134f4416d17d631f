"""Speed defaults: autocast dtype (bf16 / fp16 / tf32) and torch.compile, decided per run by measurement on the
device the run uses, where the recipe leaves them unset. A recipe that sets ``training.bf16``, ``training.fp16``,
``training.tf32``, ``training.torch_compile`` or ``training.optim`` keeps its choice; a resumed run keeps the choices
recorded at its start (the CheckpointManager records them), so its losses continue exactly.

How each lever is decided (probe.py measures, this module decides; the decision is pure, so tests feed
it the measurements of any machine):

* dtype. The probe estimates a whole training step (embeddings, head and loss at the run's vocabulary, the
  layers, the optimizer) in fp32 and each candidate dtype under autocast, as training runs it. A dtype is
  chosen when its estimated step speedup is at least DTYPE_MIN_SPEEDUP (data loading and logging are left out
  of the estimate, and a thin margin would not survive them). Seen on 2-core CPUs: bf16 4x fp32 with AMX
  (chosen); 0.5x on a Xeon with AVX-512 BF16 and no AMX, and far less where bf16 is emulated (fp32 kept); on an
  EPYC with AVX-512 BF16, 1.3-1.5x for 384-512-wide models (chosen; they trained 1.7-1.8x faster) but 0.94x for
  a 128-wide one whose 50k-vocabulary head dominates (fp32 kept). An earlier probe that timed only the matmuls
  called that small model 1.3x faster in bf16; it trained at 0.94x.
* torch.compile fuses the small operations around the matmuls; it costs a compile at start (COMPILE_WARMUP_S:
  cold, or warm when this machine already compiled this shape). The run's eager time is the probe's step
  estimate times max_steps; compile is chosen when its expected saving (COMPILE_SAVING, by device and dtype,
  from the benchmark) pays the warm-up back at least twice, and only where it is routinely used: full
  training, one process or DDP, no gradient checkpointing. On CPUs in fp32 it saves nothing: 1.06x on an AMX
  Xeon, 0.86-0.96x on an EPYC without AVX-512 (benchmarks/throughput.py, medium and large shapes); with bf16
  it fuses the casts around the matmuls (bf16 eager 0.88x, bf16 + compile 1.35x on the AMX Xeon). On a GPU the
  compile costs seconds to a minute, not the 2-core CPU's 90 s (compile_warmup_s), and it saved 21% of a bf16 step.
* On CUDA, beside the measured levers (device_levers, from the device's compute capability, no measurement): TF32
  for the fp32 matmuls that remain beside bf16 autocast (Ampere and newer), and fused AdamW (one kernel for all
  parameters; transformers' default only from torch 2.8, and the non-finite guard skips a flagged step inside it
  without a host read, training/step_faults.py).
* DDP without ``find_unused_parameters``: the Trainer turns it on for any model without gradient
  checkpointing, which costs an extra pass over the autograd graph every step (and a warning). Every
  GPT-NeoX parameter that requires a gradient gets one at every step, full training or adapters alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hftrain.model.shape import ModelShape
from hftrain.parallel.rehearsal import ZERO3_ON_CPU
from hftrain.recipe.sections import SpeedSection
from hftrain.speed.probe import (
    PROBE_BUDGET_S,
    Measurement,
    ProbeShape,
    compile_is_warm,
    expected_seconds,
    is_cached,
    mark_compiled,
    measure,
)

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe


@dataclass(frozen=True)
class SpeedPart:
    """What the speed defaults read (speed/defaults.py): finetune.method (quantized and adapter runs keep fp32 and
    eager), data.seq_len (the speed probe's shape) and the recipe's speed section (the loss, FP8)."""

    method: str
    seq_len: int
    section: SpeedSection = field(default_factory=SpeedSection)

    @classmethod
    def of(cls, recipe: Recipe) -> SpeedPart:
        return cls(method=recipe.finetune.method, seq_len=recipe.data.seq_len, section=recipe.speed)


DTYPE_MIN_SPEEDUP = 1.1  # estimated step speedup a dtype needs over fp32 (the estimate leaves out data and logging)
# share of the eager step time torch.compile saves, by (device type, dtype); see the module docstring. CUDA bf16:
# hftrain at pythia-160m, 8 x 2,048 tokens on an H200 (2026-11-27, ../shared/notes/gpu-peers.md) ran 210,865 tokens/s
# eager and 266,764 compiled: the compiled step takes 0.79 of the eager one. fp16 fuses the same casts (taken as
# bf16's); fp32 and tf32 on a GPU were not measured (the matmuls, which compile leaves alone, are a larger share of the
# step).
COMPILE_SAVING = {
    ("cpu", "fp32"): 0.0,
    ("cpu", "bf16"): 0.3,
    ("cuda", "fp32"): 0.15,
    ("cuda", "tf32"): 0.15,
    ("cuda", "bf16"): 0.21,
    ("cuda", "fp16"): 0.21,
}
COMPILE_WARMUP_S = {"cold": 90.0, "warm": 20.0}  # compile time at start on a CPU (2 cores), any model
# On a GPU: a fixed part (Triton kernels, each compiled once however many layers use it) and a part per layer (Dynamo
# traces every layer, AOTAutograd and Inductor lower each one). Calibrated on the one measurement: pythia-160m (12
# layers) on an H200 took 91 s compiled against 28 s eager for the same 50 steps (about 3-4 s of them training), so
# ~63 s of compile, cold; 30 + 2.75 x 12 = 63. Warm (Inductor's caches hold this shape) is not measured on a GPU:
# the CPU's ratio (20 / 90) is taken.
GPU_COMPILE_S = {"base": 30.0, "per_layer": 2.75, "warm_share": COMPILE_WARMUP_S["warm"] / COMPILE_WARMUP_S["cold"]}
FUSED_ADAMW = "adamw_torch_fused"
PRECISION_KEYS = ("bf16", "fp16", "tf32")
LEVER_KEYS = (*PRECISION_KEYS, "torch_compile", "optim")  # recorded at a run's start, kept when it continues


@dataclass(frozen=True)
class DeviceFacts:
    """What the speed defaults read off the training device beyond its type: a CUDA card's compute capability."""

    type: str  # cuda | cpu
    capability: tuple[int, int] | None = None  # (major, minor) on CUDA: 9.0 H100/H200, 8.0 A100, 7.5 T4

    @classmethod
    def of(cls, device: torch.device) -> DeviceFacts:
        if device.type != "cuda":
            return cls(device.type)
        return cls("cuda", tuple(torch.cuda.get_device_capability(device)))  # type: ignore[arg-type]

    @property
    def tf32(self) -> bool:
        """TF32 tensor cores: Ampere (8.0) and newer (TrainingArguments refuses tf32=True below)."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def label(self) -> str:
        return f"compute capability {self.capability[0]}.{self.capability[1]}" if self.capability else self.type


@dataclass
class SpeedPlan:
    """The levers chosen for a run, each with its reason (for the log, results.json and the report)."""

    values: dict[str, Any] = field(default_factory=dict)  # TrainingArguments keys hftrain set
    reasons: list[str] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    chunked_loss: bool = (
        False  # hftrain's chunked cross-entropy (model/fused_loss.py), decided in training/arguments.py
    )
    fp8: str | None = None  # speed.fp8's recipe (speed/fp8.py), checked here before the probe: the model's layers

    def to_json(self) -> dict[str, Any]:
        return {"values": self.values, "reasons": self.reasons, "measured": self.measured}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpeedPlan:
        return cls(dict(data["values"]), list(data["reasons"]), dict(data["measured"]))


def choose_dtype(
    part: SpeedPart, measured: Measurement | None, device: torch.device, strategy: str = "single"
) -> tuple[str, str]:
    """ "fp32" or the autocast dtype to train in, with the reason."""
    if part.method in ("qlora", "lora_8bit"):
        return "fp32", "quantized fine-tuning uses its own compute dtype"
    if device.type == "cpu" and strategy == "zero3":
        return "fp32", ZERO3_ON_CPU
    if measured is None:
        return "fp32", f"no measurement on {device.type}"
    options = {d: measured.speedup(d) for d in measured.seconds if d != "fp32"}
    if device.type == "cuda" and "bf16" in options:
        options.pop("fp16", None)  # bf16 where the GPU has it: fp16 needs loss scaling for the same speed
    best = max(options, key=options.get) if options else None
    speeds = ", ".join(f"{d} {s:.2f}x" for d, s in options.items())
    if best is None or options[best] < DTYPE_MIN_SPEEDUP:
        return "fp32", f"measured step speed vs fp32: {speeds}; none reaches {DTYPE_MIN_SPEEDUP}x"
    return best, f"measured step speed vs fp32: {speeds}"


def compile_warmup_s(device_type: str, layers: int, warm: bool) -> float:
    """Seconds torch.compile adds at the start of a run (see COMPILE_WARMUP_S and GPU_COMPILE_S)."""
    if device_type != "cuda":
        return COMPILE_WARMUP_S["warm" if warm else "cold"]
    cold = GPU_COMPILE_S["base"] + GPU_COMPILE_S["per_layer"] * layers
    return cold * GPU_COMPILE_S["warm_share"] if warm else cold


def choose_compile(
    part: SpeedPart,
    kwargs: dict[str, Any],
    strategy: str,
    eager_seconds: float,
    warm: bool,
    saving_share: float,
    device_type: str = "cpu",
    layers: int = 0,
) -> tuple[bool, str]:
    if part.method != "full":
        return False, "adapters: compile rarely pays for the small trainable part"
    if strategy not in ("single", "ddp"):
        return False, f"not with {strategy}"
    if kwargs.get("gradient_checkpointing"):
        return False, "not with gradient checkpointing"
    if saving_share <= 0:
        return False, "it was measured to save nothing for this device and precision"
    warmup = compile_warmup_s(device_type, layers, warm)
    saving = eager_seconds * saving_share
    about = (
        f"~{eager_seconds / 60:.0f} min eager, saves ~{saving:.0f} s against a ~{warmup:.0f} s "
        f"{'warm' if warm else 'cold'} compile"
    )
    if saving < 2 * warmup:
        return False, f"a short run ({about}): the compile would not pay back"
    return True, f"a long run ({about}): the compile pays back"


def decide(
    part: SpeedPart,
    kwargs: dict[str, Any],
    strategy: str,
    measured: Measurement | None,
    device: torch.device,
    warm_compile: bool,
    layers: int = 0,
) -> SpeedPlan:
    """The levers the recipe leaves unset; `kwargs` are the TrainingArguments keys it sets, `layers` the model's
    (a GPU's compile time grows with them)."""
    plan = SpeedPlan(
        measured={
            "device": str(device),
            "step_seconds": dict(measured.seconds) if measured else {},
            "cached": bool(measured and measured.cached),
        }
    )
    dtype = "fp32"
    if not any(key in kwargs for key in PRECISION_KEYS):
        dtype, why = choose_dtype(part, measured, device, strategy)
        plan.values.update({key: dtype == key for key in PRECISION_KEYS if key in dtype_keys(device)})
        plan.reasons.append(f"{dtype if dtype != 'fp32' else 'fp32 (no autocast)'} ({why})")
    if "torch_compile" not in kwargs:
        dtype = next((key for key in ("bf16", "fp16", "tf32") if kwargs.get(key)), dtype)  # the recipe's own, if set
        step = measured.seconds.get(dtype, measured.seconds["fp32"]) if measured else float("inf")
        share = COMPILE_SAVING.get((device.type, dtype), 0.0)
        on, why = choose_compile(
            part, kwargs, strategy, kwargs["max_steps"] * step, warm_compile, share, device.type, layers
        )
        plan.values["torch_compile"] = on
        plan.reasons.append(f"torch_compile={'on' if on else 'off'} ({why})")
    return plan


def undecided(kwargs: dict[str, Any]) -> list[str]:
    """What `decide` would choose for these TrainingArguments keys: the autocast dtype unless the recipe sets any
    precision key, torch.compile unless it sets torch_compile. Empty: the speed probe has nothing to decide."""
    return ([] if any(key in kwargs for key in PRECISION_KEYS) else ["dtype"]) + (
        [] if "torch_compile" in kwargs else ["torch_compile"]
    )


def device_levers(chosen: set[str], values: dict[str, Any], device: DeviceFacts) -> tuple[dict[str, Any], list[str]]:
    """The levers a CUDA device decides without a measurement, where neither the recipe nor the run's start
    (`chosen`: the keys they set) chose them; `values` are the run's TrainingArguments values so far. TF32 for the
    fp32 matmuls that remain beside bf16 autocast (the loss, anything autocast leaves in fp32) on cards that have it;
    the dtype decision's own tf32 (no autocast, TF32 matmuls) is kept. Fused AdamW on CUDA."""
    out: dict[str, Any] = {}
    reasons = []
    if "tf32" not in chosen and device.tf32 and values.get("bf16") and not values.get("tf32"):
        out["tf32"] = True
        reasons.append(f"tf32 for the fp32 matmuls beside bf16 ({device.label})")
    if "optim" not in chosen and device.type == "cuda":
        out["optim"] = FUSED_ADAMW
        reasons.append(
            f"optim={FUSED_ADAMW} (fused AdamW on CUDA: one kernel for "
            "all parameters, a non-finite step skipped on the device)"
        )
    return out, reasons


def kept_here(kept: dict[str, Any], device: DeviceFacts) -> tuple[dict[str, Any], list[str]]:
    """What a continuing run keeps from its start, less what this device cannot do: tf32 recorded on an Ampere card
    is left unset on one without TF32 (TrainingArguments refuses tf32=True there)."""
    if kept.get("tf32") and not device.tf32:
        return {k: v for k, v in kept.items() if k != "tf32"}, [
            f"tf32 from the run's start left unset: no TF32 on {device.label}"
        ]
    return kept, []


def dtype_keys(device: torch.device) -> tuple[str, ...]:
    """The TrainingArguments precision keys that apply on this device (tf32 is a CUDA setting)."""
    return PRECISION_KEYS if device.type == "cuda" else ("bf16",)


# config keys a layer's work depends on
PROBE_OPTIONS = ("hidden_act", "rotary_pct", "use_parallel_residual", "tie_word_embeddings")


def probe_shape(part: SpeedPart, kwargs: dict[str, Any], shape: ModelShape) -> ProbeShape:
    c = shape.config
    options = [(key, getattr(c, key)) for key in PROBE_OPTIONS if hasattr(c, key)]
    attention = getattr(c, "_attn_implementation", None)
    if attention:
        options.append(("attn_implementation", attention))
    trained = shape.counts["total"] if part.method == "full" else 0  # adapters: a tiny optimizer step
    return ProbeShape(
        tokens=kwargs["per_device_train_batch_size"] * part.seq_len,
        seq=part.seq_len,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        heads=c.num_attention_heads,
        vocab=c.vocab_size,
        layers=c.num_hidden_layers,
        parameters=trained,
        options=tuple(options),
    )


def decide_here(
    part: SpeedPart, kwargs: dict[str, Any], strategy: str, shape: ModelShape, device: torch.device
) -> SpeedPlan:
    """Measure on `device` (or read this machine's cached measurement) and decide."""
    if device.type == "cpu" and strategy == "zero3":  # fp32 only, compile never: nothing a measurement would decide
        return decide(part, kwargs, strategy, None, device, warm_compile=False)
    probe = probe_shape(part, kwargs, shape)
    accumulation = kwargs.get("gradient_accumulation_steps", 1)
    if not is_cached(probe, device) and (cost := expected_seconds(probe, device)) > PROBE_BUDGET_S:
        return fallback_without_probe(
            kwargs,
            device,
            f"the speed probe would take about {cost:,.0f} s at this model's shape "
            f"here, more than the {PROBE_BUDGET_S:.0f} s it may; set them in the recipe to choose",
        )
    try:
        measured = measure(probe, device)
    except torch.OutOfMemoryError:  # not even one sequence of one layer fits beside what the device holds
        return fallback_without_probe(kwargs, device)
    per_step = Measurement({k: v * accumulation for k, v in measured.seconds.items()}, measured.device, measured.cached)
    plan = decide(part, kwargs, strategy, per_step, device, compile_is_warm(probe, device), probe.layers)
    if plan.values.get("torch_compile"):
        mark_compiled(probe, device)
    return plan


def fallback_without_probe(
    kwargs: dict[str, Any], device: torch.device, why: str = "the speed probe did not fit in the device's memory"
) -> SpeedPlan:
    """No probe (it did not fit in the device's memory, or would take too long): bf16 on a GPU that has it (its
    fast dtype for any model that fills it), fp32 elsewhere; no compile (its pay-back cannot be estimated)."""
    plan = SpeedPlan(measured={"device": str(device), "step_seconds": {}, "cached": False})
    if not any(key in kwargs for key in PRECISION_KEYS):
        fast = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
        plan.values.update({key: fast == key for key in PRECISION_KEYS if key in dtype_keys(device)})
        plan.reasons.append(f"{fast if fast != 'fp32' else 'fp32 (no autocast)'} ({why})")
    if "torch_compile" not in kwargs:
        plan.values["torch_compile"] = False
        plan.reasons.append(f"torch_compile=off ({why})")
    return plan
