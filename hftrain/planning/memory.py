"""Peak memory per process, predicted on paper: what `hftrain plan` prints before anyone rents a GPU.

A run's peak is the larger of two moments (measured per phase on CPUs, VmHWM reset at each Trainer event):
- a training step, just before backward frees the activations: weights, gradients, optimizer state, the
  activations saved for backward, and the logits with the loss's working set;
- the final evaluation: weights and optimizer state, plus what the allocator kept of the steps' freed blocks,
  and the evaluation batch's logits with the loss's working set (transformers' cross-entropy:
  log-probabilities as large as the logits). With a 50k vocabulary this is often the larger one.
On a CPU the whole process counts (RSS): the libraries' own footprint (measured here once, cached per library
versions), hftrain's runtime (tokenizer, Trainer) and the data pipeline's shuffle windows come on top. On a GPU the
figures are what torch's allocator hands out (`torch.cuda.max_memory_allocated`); the CUDA context is listed apart.
`benchmarks/plan_calibration.py` compares this with measured peaks on a grid of real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hftrain.planning.part import PlanPart
from hftrain.recipe.objectives import OBJECTIVES

GB = 1e9
LIBRARIES_FALLBACK_BYTES = (
    0.6e9  # CPU: the libraries' footprint before `hftrain plan` has measured it here (0.55 GB measured)
)
CPU_RUNTIME_BYTES = 150e6  # tokenizer, Trainer, thread pools, allocator slack: calibrated (plan_calibration.py)
KEPT_AFTER_TRAINING = 1.25  # CPU: x the gradients' bytes, what glibc keeps of the steps' freed blocks (calibrated)
# CPU: LoRA/QLoRA steps peak this much higher in activations than full training (calibrated; unmeasured on GPUs)
ADAPTER_ACTIVATIONS = 1.65
ADAPTER_BASE_COPY = (
    0.5  # CPU: and hold about half the fp32 base's bytes more during a step (peft's wrapped forward; calibrated)
)
# DPO: tokens x vocabulary TRL's fused LM head projects at a time (trl.kernels, TRL 1.16)
FUSED_HEAD_TILE = (4096, 32768)
CUDA_CONTEXT_BYTES = 0.5e9  # CUDA context and kernels, outside the allocator (not in max_memory_allocated)
LOGIT_BYTES = {  # working set per logit: (training step, evaluation)
    ("cpu-chunked", "fp32"): (8, 8),  # logits + the chunked loss's gradient (fused_loss.py); eval: + log-probs
    ("cpu-chunked", "bf16"): (6, 10),
    ("native", "fp32"): (12, 8),  # logits, log-probs, their gradient
    ("native", "bf16"): (14, 10),  # bf16 logits, fp32 copy, log-probs, gradient, its bf16 cast
    # CUDA (measured on an H200, 2026-11-26, pythia-160m 8 x 1,024: 11.07 bytes per logit with and without
    # checkpointing); fp32 as on CPUs until measured
    ("cuda-native", "fp32"): (12, 8),
    ("cuda-native", "bf16"): (11, 10),
}


@dataclass(frozen=True)
class RunShape:
    """How the recipe would run: what the peak depends on besides the model."""

    device: str = "cpu"  # cpu | cuda
    processes: int = 1
    strategy: str = "single"  # single | ddp | fsdp | zero3 | zero3_offload
    micro_batch: int = 1
    eval_batch: int = 8
    seq_len: int = 128
    checkpointing: bool = False
    dtype: str = "fp32"  # fp32 | bf16 (autocast; fp16 counts as bf16)
    attention: str = "sdpa"
    chunked_loss: bool = True  # CPU eager training uses hftrain's chunked loss
    document_mask: bool = False  # packed documents kept apart (data.masks_documents)
    objective: str = "lm"  # lm | dpo: a pair is two rows (chosen, rejected), scored by TRL's fused head


@dataclass
class PeakPrediction:
    """Bytes per process by component at the peak moment, and the other moment's total for comparison."""

    parts: dict[str, float]
    phase: str  # "training step" | "final evaluation"
    other_phase_total: float

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def run_shape(
    part: PlanPart,
    device: str = "cpu",
    processes: int = 1,
    strategy: str | None = None,
    micro_batch: int | None = None,
    checkpointing: bool | None = None,
    eval_batch: int | None = None,
) -> RunShape:
    """The recipe as it would run on `processes` processes of `device`."""
    t = part.training
    explicit = {"bf16", "fp16"} & t.model_fields_set
    # unset on a GPU: the speed defaults turn bf16 autocast on (speed/defaults.py); on a CPU they measure first
    bf16 = bool(t.bf16 or t.fp16) if explicit else device == "cuda"
    return RunShape(
        device=device,
        processes=processes,
        strategy=strategy
        or ("single" if processes == 1 else part.strategy if part.strategy not in ("auto", "single") else "ddp"),
        micro_batch=micro_batch or t.per_device_train_batch_size,
        eval_batch=min(eval_batch or t.per_device_eval_batch_size, part.data.eval_blocks),
        document_mask=part.data.masks_documents,
        seq_len=part.data.seq_len,
        checkpointing=t.gradient_checkpointing if checkpointing is None else checkpointing,
        dtype="bf16" if bf16 else "fp32",
        attention=part.attention or "sdpa",
        chunked_loss=device == "cpu"
        and not t.torch_compile
        and not OBJECTIVES[part.finetune.objective].tiled_loss_head,
        objective=part.finetune.objective,
    )


def layer_activations(config: Any, tokens: int, shape: RunShape) -> list[float]:
    """Bytes of each tensor one GPTNeoXLayer saves for backward (its input, norms, projections, attention, MLP)."""
    d, f, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    low = 2 if shape.dtype == "bf16" else 4  # what autocast saves for matmuls
    saved = [4 * d, low * d, low * 3 * d, low * 2 * d, low * d, low * d, low * d, low * f, low * f, 6 * d]
    # residual input (fp32), attention norm out, qkv, rotated q and k (transformers casts cos/sin to q's dtype:
    # bf16 under autocast, 4 x hidden bytes less per token than fp32, as measured on an H200), attention out, its
    # reshape for the output projection, MLP norm out, MLP up projection, GELU, and the rest (norm statistics,
    # rotary halves): 78 bytes x hidden per token in fp32, as torch's saved-tensor hooks count it
    if shape.attention == "eager":
        saved.append(low * heads * shape.seq_len)  # softmax probabilities: heads x seq_len per token
    elif shape.document_mask and not shape.attention.startswith("flash"):
        saved.append(4 * shape.seq_len)  # the block-causal mask each layer keeps (seq_len per token)
    return [tokens * b for b in saved]


def activations(config: Any, shape: RunShape) -> float:
    """Bytes saved for backward over a micro-batch: every layer's, or under gradient checkpointing each layer's
    input and one layer recomputed at a time; plus the final norm's input and output. Under DPO each pair is
    two rows (TRL runs chosen and rejected as one batch)."""
    tokens = shape.micro_batch * shape.seq_len * rows_per_sample(shape)
    layer = sum(layer_activations(config, tokens, shape))
    head = 2 * 4 * tokens * config.hidden_size
    if shape.checkpointing:
        return config.num_hidden_layers * 4 * tokens * config.hidden_size + layer + head
    return config.num_hidden_layers * layer + head


def rows_per_sample(shape: RunShape) -> int:
    return OBJECTIVES[shape.objective].rows_per_example


def state_bytes(part: PlanPart, info: dict[str, Any], shape: RunShape) -> dict[str, float]:
    """Weights, gradients and AdamW state per process for the recipe's fine-tuning method and the strategy."""
    m = info["finetune_bytes"]["methods"][part.finetune.method]
    weights, grads, optim = float(m["weights"]), float(m["gradients"]), float(m["optimizer"])
    if shape.strategy in ("fsdp", "zero3", "zero3_offload"):
        p = shape.processes
        if shape.device == "cpu":
            # a CPU rehearsal builds the whole model in every process before sharding it, and unshards each
            # unit's gradients before reducing them: glibc keeps those freed blocks, so only AdamW shrinks
            return {"weights": weights + weights / p, "gradients": grads, "optimizer": optim / p}
        unit = 4 * info["largest_layer_params"]  # one layer gathered at a time, the next prefetched
        root = 4 * (info["parameters"]["total"] - info["layer_params"])  # embeddings and head: gathered all step
        weights, grads, optim = weights / p + 2 * unit + root, grads / p + 2 * unit + root, optim / p
        if shape.strategy == "zero3_offload":
            weights, grads, optim = 2 * unit + root, 2 * unit + root, 0.0  # the sharded state lives in host memory
    return {"weights": weights, "gradients": grads, "optimizer": optim}


def reference_bytes(part: PlanPart, info: dict[str, Any], shape: RunShape) -> float:
    """DPO with full fine-tuning keeps a frozen copy of the starting weights as its reference, built and sharded
    (TRL's prepare_fsdp / prepare_deepspeed) as the policy's weights are; with an adapter the reference is the
    base with the adapter disabled: nothing more."""
    if not OBJECTIVES[shape.objective].reference_copy or part.finetune.method != "full":
        return 0.0
    return state_bytes(part, info, shape)["weights"]


def logit_bytes(vocab: int, shape: RunShape) -> tuple[float, float]:
    """Bytes of the logits and loss of one training micro-batch and of one evaluation batch."""
    loss = "cpu-chunked" if shape.chunked_loss else "cuda-native" if shape.device == "cuda" else "native"
    train_logit, eval_logit = LOGIT_BYTES[(loss, shape.dtype)]
    if not OBJECTIVES[shape.objective].tiled_loss_head:
        return (
            train_logit * shape.micro_batch * shape.seq_len * vocab,
            eval_logit * shape.eval_batch * shape.seq_len * vocab,
        )
    # TRL's fused head scores log-probabilities in tiles (no batch x seq_len x vocab logits); the evaluation's
    # preference accuracy (eval/preference_accuracy.py) bounds its logits per forward
    from hftrain.eval.preference_accuracy import LOGIT_BUDGET_BYTES

    tokens, columns = FUSED_HEAD_TILE
    # the fp32 tile, and half as much again for its log-sum-exp (calibrated: plan_calibration.py's DPO rows)
    tile = 1.5 * 4 * min(tokens, 2 * shape.micro_batch * shape.seq_len) * min(columns, vocab)
    per_row = 2 * 4 * shape.seq_len * vocab  # logits and log-probabilities of one held-out answer
    return tile, max(tile, max(per_row, min(LOGIT_BUDGET_BYTES, 2 * shape.eval_batch * per_row)))


def predict_peak(
    part: PlanPart, info: dict[str, Any], shape: RunShape | None = None, libraries: float | None = None
) -> PeakPrediction:
    """Peak bytes per process of the recipe (its `part`) run as `shape` (default: one CPU process as the recipe says);
    `info` is `estimates.plan(PlanPart.of(recipe))`."""
    shape = shape or run_shape(part)
    config = info["config"]
    state = state_bytes(part, info, shape)
    act = activations(config, shape)
    if part.finetune.method != "full" and shape.device == "cpu":
        act = act * ADAPTER_ACTIVATIONS + ADAPTER_BASE_COPY * 4 * info["parameters"]["total"]
    train_logits, eval_logits = logit_bytes(config.vocab_size, shape)
    if shape.device == "cpu":
        fixed = {
            "libraries": libraries if libraries is not None else library_footprint(),
            "runtime": CPU_RUNTIME_BYTES,
            "data pipeline": data_pipeline_bytes(part, shape.processes),
        }
        kept = KEPT_AFTER_TRAINING * state["gradients"]
    else:
        fixed, kept = {}, 0.0
    autocast_cache = 0.0  # autocast keeps a bf16 copy of each fp32 weight it casts until backward is done
    if shape.dtype == "bf16" and part.finetune.method in ("full", "lora"):
        held = state["weights"] / float(info["finetune_bytes"]["methods"][part.finetune.method]["weights"])
        autocast_cache = 2 * info["matmul_params"] * min(held, 1.0)  # sharded: only the gathered layers
    # backward frees the activations as it fills the gradients: the step peaks at the larger of the two
    step = {"activations": act, "logits and loss": train_logits}
    if autocast_cache:
        step["autocast weight copies"] = autocast_cache
    if state["gradients"] > sum(step.values()):
        step = {"gradients": state["gradients"]}
    copy = reference_bytes(part, info, shape)
    reference = {"reference weights": copy} if copy else {}
    train = {**fixed, "weights": state["weights"], **reference, "optimizer": state["optimizer"], **step}
    evaluation = {
        **fixed,
        "weights": state["weights"],
        **reference,
        "optimizer": state["optimizer"],
        "kept freed blocks": kept,
        "evaluation logits and loss": eval_logits,
    }
    t_total, e_total = sum(train.values()), sum(evaluation.values())
    if t_total >= e_total:
        return PeakPrediction(train, "training step", e_total)
    return PeakPrediction(evaluation, "final evaluation", t_total)


def data_pipeline_bytes(part: PlanPart, processes: int) -> float:
    """The shuffle windows this process fills (int32 tokens) when it reads in its main process; DataLoader
    workers hold theirs in their own processes. Host memory: on GPUs it is not in the device's peak."""
    from hftrain.parallel.readers import decide_readers, decide_window

    workers = part.training.dataloader_num_workers
    readers = decide_readers(part.data.readers, None, None, processes, max(workers, 1))
    window = decide_window(part.data.shuffle_window, None, readers, part.data.seq_len)
    return 0.0 if workers else -(-readers // processes) * window * part.data.seq_len * 4


def import_training_libraries() -> None:
    """Import the libraries `hftrain train` imports before it builds a model: their footprint is the libraries' part
    (by name: hftrain's own modules are small, and importing the training package from here would be a cycle)."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import transformers.trainer  # noqa: F401


def library_footprint(measure: bool = False) -> float:
    """RSS of a process that imported the training libraries (bytes), measured once per library versions and
    cached with the speed probe's measurements (HFTRAIN_CACHE_DIR). `measure`: this process holds nothing else yet
    (the `plan` CLI), so a missing figure is measured here; otherwise (a training run, a notebook) a missing one is
    LIBRARIES_FALLBACK_BYTES and nothing is cached."""
    from importlib import metadata

    from hftrain import _cache

    versions = ",".join(
        f"{p}={_version(metadata, p)}"
        for p in ("torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes", "deepspeed")
    )
    cached = _cache.read_json("library_footprint.json")
    if (
        isinstance(cached, dict)
        and cached.get("versions") == versions
        and isinstance(cached.get("bytes"), (int, float))
    ):
        return float(cached["bytes"])
    if not measure:
        return LIBRARIES_FALLBACK_BYTES
    import_training_libraries()
    measured = _current_rss()
    _cache.write_json("library_footprint.json", {"versions": versions, "bytes": measured})
    return measured


def _version(metadata: Any, name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def _current_rss() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss)
