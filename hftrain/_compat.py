"""Every patch hftrain applies to another library (and to the C library), in one place.

Nothing here runs on import: each patch is a function that the point of a run needing it calls, and each says
what it changes, the version it was seen with, the upstream issue, and when it is active. The CPU-only ones
(marked CPU) change nothing on CUDA; with hftrain's CPU rehearsals (parallel/rehearsal.py) they are the whole of
what hftrain does differently on a machine without a GPU.

Each entry: function: library (seen with); active when; upstream.

- quiet_optional_warnings: bitsandbytes 0.50; any run or CLI command (a logger level); bitsandbytes#2064 (open).
- quiet_launcher_cpp_logs: torch 2.13 (c10d); a launcher process, before torch is imported; none filed.
- quiet_trl_deprecations: TRL 1.16, transformers 5.x; a DPO run (a warnings filter); none filed.
- quiet_collective_deprecations: DeepSpeed 0.19, torch 2.13; a ZeRO-3 run (a warnings filter); none filed.
- skip_unneeded_imports: accelerate 1.10-1.15, DeepSpeed 0.19; any run; unwrapping behaves the same;
  accelerate#1952, transformers#26308.
- hub_request_timeouts: huggingface_hub 1.31-2.x; any command (hftrain/network.py); huggingface_hub#3750, #3790.
- plain_gcs_filesystem: gcsfs >= 2025; before gcsfs is first imported (gs:// data); none filed
  (fake-gcs-server#2069).
- deepspeed_cpu_process_group: accelerate 1.15, DeepSpeed 0.19; CPU: a ZeRO-3 rehearsal; none filed (GPU-only
  upstream).
- skip_shm_comm_build: DeepSpeed 0.16-0.19; CPU: a ZeRO-3 rehearsal; none filed.
- fsdp_state_for_cpu: accelerate 1.15; CPU: an FSDP rehearsal; accelerate#2741 (CPU launch).
- bnb_4bit_trainable_on_cpu: bitsandbytes 0.48-0.50; CPU: a 4-bit (QLoRA) model; none filed (since
  bitsandbytes#1804).
- keep_freed_memory: glibc malloc; CPU: a process that trains on the CPU (Linux/glibc); none filed (pytorch#55675).
- universal_load_fixes: DeepSpeed 0.19; ZeRO-3 resumed on another process count; DeepSpeed#7585 (param groups).
- exact_compiled_casts: torch 2.13 Inductor, torchao 0.18; a run with speed.fp8: rowwise; pytorch#150859
  (torchtitan#1056).
- flex_uncompiled_on_cpu: transformers 5.x, torch 2.13 Inductor; CPU: flex_attention (check-packing); none filed
  (AVX2-only CPUs).

The Trainer's private methods hftrain overrides are not patches (a subclass of its own); they are listed with
their reasons in training/trainer.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any

from hftrain.errors import HftrainError

CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
_CHILD_CPP_LOG_LEVEL_ENV = "HFTRAIN_CHILD_CPP_LOG_LEVEL"  # what the launched processes get back ("" : torch's default)


def quiet_launcher_cpp_logs(argv: list[str]) -> None:
    """In a process that launches others (`hftrain train ... --accelerate-config`), torch's C++ logging is set to
    FATAL before torch is imported (c10 reads TORCH_CPP_LOG_LEVEL once, at import): c10d logs each failed
    connection to a missing head node as an error with its C++ backtrace (30 frames, twice) before the Python
    exception that hftrain turns into its one line (parallel/child_errors.py), and each retry as a warning. The
    launched processes get the level they would have had (launch_environment_cpp_logs): their c10d and NCCL
    messages stay. A level the user set is kept everywhere."""
    if CPP_LOG_LEVEL_ENV in os.environ or "LOCAL_RANK" in os.environ or argv[:1] != ["train"]:
        return
    if not any(a == "--accelerate-config" or a.startswith("--accelerate-config=") for a in argv):
        return
    os.environ[_CHILD_CPP_LOG_LEVEL_ENV] = ""
    os.environ[CPP_LOG_LEVEL_ENV] = "FATAL"


def launch_environment_cpp_logs() -> dict[str, str]:
    """The C++ log level for processes this launcher starts: torch's own default (WARNING) unless the user set one."""
    if os.environ.get(_CHILD_CPP_LOG_LEVEL_ENV) is None:
        return {}
    return {CPP_LOG_LEVEL_ENV: os.environ[_CHILD_CPP_LOG_LEVEL_ENV] or "WARNING"}


def quiet_optional_warnings() -> None:
    """bitsandbytes 0.50's CPU backend logs a warning on import that an optional kernel package is absent; it is
    not needed for anything hftrain does. Upstream: none filed (a logger level, not a behaviour change)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def quiet_trl_deprecations() -> None:
    """TRL 1.16's DPOTrainer reads ``model.is_gradient_checkpointing``, which transformers 5 deprecates with a
    FutureWarning at every evaluation and save: the user can do nothing about it. One message filtered; the
    attribute still works. Upstream: none filed (TRL will move to ``is_activation_checkpointing``)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def quiet_collective_deprecations() -> None:
    """torch 2.13 deprecates ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with a FutureWarning, and
    DeepSpeed 0.19's ZeRO-3 calls them for every gathered parameter: a two-line warning was printed 300 times in
    an 8-step run (warnings filters that change during a run reset Python's "once per place" memory), over 64 KB
    of a log that says nothing the user can act on. Two messages filtered; the calls still work. Upstream: none
    filed (DeepSpeed will move to the ``_single`` forms)."""
    import warnings

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings(
            "ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning
        )


def skip_unneeded_imports() -> None:
    """accelerate's ``unwrap_model`` (the Trainer's __init__, its saves, hftrain's evaluation) imports DeepSpeed
    whenever the package is installed, to check whether the model is a ``DeepSpeedEngine``: 1.8-3.6 s on a 2-core
    CPU, every run (DeepSpeed 0.19 also imports mlflow through its autotuner). A model can only be a
    DeepSpeedEngine if DeepSpeed was imported first, so "is deepspeed already imported, and installed" gives the
    same unwrapping without the import. Only ``accelerate.utils.other`` sees the narrower check; every other
    DeepSpeed check in accelerate and transformers is untouched. Seen with accelerate 1.10-1.15; another layout
    keeps its behaviour (slower start, same results). Upstream: accelerate imports DeepSpeed eagerly wherever
    ``is_deepspeed_available()`` is true (no issue filed for the unwrap path)."""
    try:
        from accelerate.utils import other
    except ImportError:
        return
    check = getattr(other, "is_deepspeed_available", None)
    if check is None or getattr(check, "hftrain_narrowed", False):
        return

    def deepspeed_in_use() -> bool:
        return "deepspeed" in sys.modules and check()

    deepspeed_in_use.hftrain_narrowed = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = deepspeed_in_use


def hub_request_timeouts(per_request_s: float) -> None:
    """huggingface_hub 1.x/2.x (httpx, httpx2) sets no read timeout on uploads and API calls, so an endpoint that
    accepts the connection and never answers hangs a push for ever. Its public ``set_client_factory`` takes a factory:
    each new client gets the per-request timeout. The download/etag constants are set too (read at call time).
    Upstream: huggingface_hub#3750 / #3790 (no timeout by default since the move to httpx)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    constants.HF_HUB_ETAG_TIMEOUT = constants.HF_HUB_DOWNLOAD_TIMEOUT = max(1, int(per_request_s))
    default_factory = _http.default_client_factory

    def client() -> Any:
        session = default_factory()
        session.timeout = per_request_s  # the client's setter makes the Timeout (httpx2 from hub 2.0, httpx before)
        return session

    _http.set_client_factory(client)


def plain_gcs_filesystem() -> None:
    """gcsfs (>= 2025) defaults to a filesystem that asks Google's gRPC control plane for each bucket's layout
    before every open; against any other endpoint (an emulator, a proxy: storage_options.endpoint_url) that lookup
    blocks ~60 s per shard before falling back. Reading objects needs only the JSON API, so hftrain asks for plain
    gcsfs unless the variable is already set (true brings gcsfs's zonal/HNS bucket support back). Read by gcsfs
    at import: active only before gcsfs is first imported."""
    if "gcsfs" not in sys.modules:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


# ---------------------------------------------------------------------------------------- CPU only
def deepspeed_cpu_process_group() -> None:
    """CPU (ZeRO-3 rehearsal): DeepSpeed on CPU needs ``DS_ACCELERATOR=cpu`` (set by the launcher) and
    accelerate's state created on gloo *before* TrainingArguments exist, while ``ACCELERATE_USE_DEEPSPEED`` is
    set; without that, with accelerate 1.15 and DeepSpeed 0.19 every rank reported num_processes=1, did not split
    the data and wrote the same files, with no error. accelerate supports DeepSpeed on GPUs only."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def skip_shm_comm_build() -> None:
    """CPU (ZeRO-3 rehearsal): DeepSpeed's CPU communication backend compiles its shared-memory all-reduce op
    (``deepspeed_shm_comm``, C++ with g++) when it starts, in every rank: 30-80 s on 2 cores the first time in a
    venv, and a build check every start after. Only ``inference_all_reduce`` (DeepSpeed inference's tensor
    parallelism) uses it; training's collectives are torch.distributed's (gloo here). Marked not compatible, it
    is never built and the backend is the same gloo one. DeepSpeed reads the mark from
    ``deepspeed.ops.__compatible_ops__`` (a dict it keeps for edits, 0.16-0.19). Upstream: none filed."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def fsdp_state_for_cpu(trainer: Any) -> None:
    """CPU (FSDP rehearsal): accelerate 1.15 never enables FSDP for CPU processes, so the Accelerator comes up as
    MULTI_CPU (plain DDP) even with the FSDP plugin. Its state is switched to FSDP with the plugin the Trainer
    built from TrainingArguments; ``parallel.dims.verify`` then checks accelerate's state, and the tests check
    that parameters really are sharded."""
    if trainer.is_fsdp_enabled or not _on_cpu():
        return
    from accelerate import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    # AcceleratorState copies the distributed type from PartialState whenever accelerate makes one again
    # (preparing the optimizer and scheduler, syncing RNG state): switch it there too, or it reverts to MULTI_CPU
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def bnb_4bit_trainable_on_cpu(model: Any) -> None:
    """CPU: bitsandbytes 0.48-0.50 4-bit on an avx512_bf16 CPU repacks Linear4bit weights for CPU inference on any
    no-grad forward, and training afterwards fails ("a view of a leaf Variable that requires grad is being used
    in an in-place operation"); turning that repacking off fixes it. A no-op with CUDA."""
    if not _on_cpu():
        return
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's adaptive rule pairs with it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def keep_freed_memory(device: Any) -> str | None:
    """CPU: glibc's malloc returns freed memory to the kernel by a threshold it adapts to the process's history:
    blocks above the mmap threshold are unmapped on free, and a thread's heap is trimmed when more than twice that
    is free at its top. A training step frees and allocates the same activation buffers every step, and where the
    threshold stayed low (it depends on what the process freed before) every step page-faults them in again:
    ~300 minor faults and 56 ms per step at a 4 x 128 model with a 64-token context against 0.3 faults and 44 ms
    with the threshold pinned (2-core EPYC, one process). Pinned at glibc's own ceiling for the adaptive value
    (32 MB; trimming at 64 MB). On CUDA tensors live in torch's caching allocator: nothing is changed there.
    Returns what it did, for the run's speed log, or None where nothing changed (a GPU, another C library).
    Process-wide, and set before the speed probe, which times steps as training runs them."""
    if getattr(device, "type", device) != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return f"memory: freed blocks up to {MMAP_THRESHOLD >> 20} MB kept for reuse (glibc malloc, CPU training)"


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def exact_compiled_casts() -> None:
    """Inductor fuses away the low-precision casts eager mode rounds at, so an intermediate recomputed in the
    backward can differ from the forward's; with torchao's rowwise FP8 scales that gave NaNs in torchtitan
    (torchtitan#1056). torchtitan's short-term fix, taken here for speed.fp8: rowwise (speed/fp8.py): Inductor's
    ``emulate_precision_casts`` on, process-wide (a little slower). Upstream: pytorch#150859."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True


def flex_uncompiled_on_cpu() -> None:
    """CPU. transformers runs flex_attention through torch.compile (integrations/flex_attention.py,
    WrappedFlexAttention), and Inductor's CPU flex template is wrong on some machines: on a 2-core AVX2-only EPYC
    with torch 2.13 the compiled kernel gave max |diff| 1.9 (and NaN at 56 tokens) against the masked softmax for
    packed documents of 24-56 tokens, compiled per shape or with dynamic shapes (issue 55 saw it after other shapes
    had compiled in the process; AVX-512 machines were right). On a CPU, flex_attention runs uncompiled here: torch's
    unfused implementation, the full score matrix, exact on every instruction set, and no compile (seconds saved).
    A CPU never trains with flex (model/attention.py refuses it); `hftrain data inspect --check-packing` compares
    its forward. CUDA keeps transformers' compiled kernel. Idempotent."""
    import warnings

    import torch
    import transformers.integrations.flex_attention as flex

    if getattr(flex.compile_friendly_flex_attention, "hftrain_uncompiled_on_cpu", False):
        return
    upstream = flex.compile_friendly_flex_attention

    def uncompiled_on_cpu(query: Any, key: Any, value: Any, training: bool = False, **kwargs: Any) -> Any:
        if query.is_cuda or torch.compiler.is_dynamo_compiling():
            return upstream(query, key, value, training=training, **kwargs)
        with warnings.catch_warnings():  # torch's advice to compile it: on a CPU, that is what is wrong
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex.flex_attention(query, key, value, **kwargs)

    uncompiled_on_cpu.hftrain_uncompiled_on_cpu = True  # type: ignore[attr-defined]
    flex.compile_friendly_flex_attention = uncompiled_on_cpu


# ------------------------------------------------------------------------------------------ DeepSpeed
def universal_load_fixes(saved_file: Path) -> Any:
    """Two things DeepSpeed 0.19's universal load (stage3.py, load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    gets wrong, put right at train begin, after the load and before any other callback or step. Active only when a
    ZeRO-3 run resumes a checkpoint written by another process count (checkpoint/elastic.py inserts it):

    * every optimizer param group gets the FIRST group's hyper-parameters ("Generally, the hyperparameters of each
      parameter should be the same"). The Trainer's AdamW has two groups, weight decay 0.1 and 0.0 (biases and
      norms), so the no-decay group would get weight decay: each group gets its own saved settings back;
    * every parameter's Adam `step` is the SAME tensor object, and AdamW advances steps in place, once per
      parameter: the bias correction then runs ahead. Each parameter gets its own copy.
    Each alone made resumed losses drift (8e-5, then 4e-5 relative by the second step, growing after)."""
    from transformers import TrainerCallback

    class UniversalLoadFixes(TrainerCallback):  # saved_file: the universal conversion's zero/optimizer_state.pt
        def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
            import torch

            # hftrain's own conversion
            saved = torch.load(saved_file, weights_only=False)["optimizer_state_dict"]["param_groups"]
            groups = optimizer.param_groups
            if len(saved) != len(groups):
                raise HftrainError(
                    f"{saved_file}: {len(saved)} optimizer param groups saved, {len(groups)} now; the "
                    "optimizer changed since the checkpoint was written, so its state cannot be continued."
                )
            for group, settings in zip(groups, saved):
                group.update({key: value for key, value in settings.items() if key != "params"})
            inner = optimizer
            while hasattr(inner, "optimizer"):  # accelerate's wrapper -> ZeRO's optimizer -> the torch AdamW
                inner = inner.optimizer
            for param_state in inner.state.values():
                if torch.is_tensor(param_state.get("step")):
                    param_state["step"] = param_state["step"].clone()

    return UniversalLoadFixes()
