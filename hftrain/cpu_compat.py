"""Everything hftrain does differently to rehearse distributed backends on CPUs, in one place.

Active only when (1) CUDA is absent AND (2) hftrain's own CPU launcher started the process (it sets
``HFTRAIN_CPU_REHEARSAL``). On a GPU machine, or under a plain ``accelerate launch``, nothing here runs:
no forced distributed type, no gloo, no use_cpu. (``fix_bnb_4bit`` and ``keep_freed_memory`` are the CPU fixes
outside rehearsals: they act where a process trains on the CPU, whoever launched it.)

What was seen on CPUs with accelerate 1.15 and DeepSpeed 0.19, and what each function does about it:

* ``launch_processes``: accelerate starts ONE process for a ``MULTI_CPU`` config (multi-process CPU means
  mpirun there) and never enables FSDP or DeepSpeed for CPU processes. So hftrain starts the processes itself
  with torchrun, on gloo, with the GPUs hidden (``CUDA_VISIBLE_DEVICES=""``): `--cpu` on a GPU machine
  rehearses on CPU as asked instead of silently running DDP on the GPUs.
* ``prepare_process`` (the only side effect, called once by ``parallel.resolve_launch``): DeepSpeed on CPU
  needs ``DS_ACCELERATOR=cpu`` (set by the launcher) and the process group created on gloo *before*
  TrainingArguments exist, while ``ACCELERATE_USE_DEEPSPEED`` is set; without that, every rank reported
  num_processes=1, did not split the data and wrote the same files, with no error.
* ``training_kwargs`` (pure): the TrainingArguments a rehearsal needs: gloo, ``use_cpu`` for DDP/FSDP, the
  FSDP plugin options from the accelerate YAML, and for ZeRO-3 ``use_cpu=False`` (use_cpu turns DeepSpeed
  off) with ``use_configured_state`` so the Trainer keeps the state made by ``prepare_process``.
* ``after_accelerator``: the Accelerator comes up as MULTI_CPU (plain DDP) even with the FSDP plugin; its
  state is switched to FSDP with the plugin the Trainer built from TrainingArguments. ``parallel.verify``
  then checks accelerate's state, and the tests check that parameters really are sharded.
* ``fix_bnb_4bit``: bitsandbytes 4-bit on an avx512_bf16 CPU repacks Linear4bit weights for CPU inference on
  any no-grad forward, and training afterwards fails ("a view of a leaf Variable that requires grad is being
  used in an in-place operation"); turning that repacking off fixes it. Needed in any CPU process, a no-op
  with CUDA.
* ``keep_freed_memory``: glibc's malloc returns freed memory to the kernel by a threshold it adapts to the
  process's history: blocks above the mmap threshold are unmapped on free, and a thread's heap is trimmed
  when more than twice that is free at its top. A training step frees and allocates the same activation
  buffers every step, and where the threshold stayed low (it depends on what the process freed before:
  a run_clm-style script that tokenized a dataset first had it high, hftrain had it low) every step
  page-faults them in again: ~300 minor faults and 56 ms per step at a 4 x 128 model with a 64-token
  context against 0.3 faults and 44 ms with the threshold pinned (2-core EPYC, one process, same run).
  Pinning it at glibc's own ceiling for the adaptive value (32 MB; trimming at 64 MB) makes every CPU run
  reuse its buffers. On CUDA tensors live in torch's caching allocator: nothing is changed there.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REHEARSAL_ENV = "HFTRAIN_CPU_REHEARSAL"  # ddp | fsdp | zero3
CONFIG_ENV = "HFTRAIN_ACCELERATE_CONFIG"  # the accelerate YAML the rehearsal follows


MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc's adaptive rule pairs with it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def rehearsal_backend() -> str | None:
    """The backend hftrain's CPU launcher started this process for, or None (always None with CUDA)."""
    return os.environ.get(REHEARSAL_ENV) if on_cpu() else None


def launch_processes(hftrain_args: list[str], config_path: Path, backend: str, nproc: int) -> int:
    """Run `python -m hftrain HFTRAIN_ARGS` in `nproc` gloo processes through torchrun; returns its exit code."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # asked for a CPU rehearsal: never the GPUs, even where there are some
    env[REHEARSAL_ENV] = backend
    env[CONFIG_ENV] = str(config_path.resolve())
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if backend == "zero3":
        env["DS_ACCELERATOR"] = "cpu"
    # --standalone: a local c10d rendezvous on a port torchrun picks itself (no free-port race)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "hftrain", *hftrain_args]
    return subprocess.call(cmd, env=env)


def prepare_process(backend: str) -> None:
    """The process-wide set-up a rehearsal needs before TrainingArguments exist (ZeRO-3 only)."""
    if backend == "zero3":
        _deepspeed_process_group()


def training_kwargs(kwargs: dict[str, Any], backend: str | None) -> dict[str, Any]:
    """TrainingArguments changes for a CPU rehearsal of the backend the accelerate YAML describes."""
    if backend is None:
        return kwargs
    import yaml

    kwargs = dict(kwargs)
    config_path = Path(os.environ[CONFIG_ENV])
    config = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    kwargs["ddp_backend"] = "gloo"
    if backend == "ddp":
        kwargs["use_cpu"] = True
    elif backend == "fsdp":
        fsdp = {k.removeprefix("fsdp_"): v for k, v in (config.get("fsdp_config") or {}).items()}
        fsdp["cpu_offload"] = bool(fsdp.pop("offload_params", False))
        kwargs.update(use_cpu=True, fsdp="full_shard auto_wrap", fsdp_config=fsdp)
    elif backend == "zero3":
        ds_file = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
        kwargs.update(
            use_cpu=False,
            deepspeed=str((config_path.parent / ds_file).resolve()) if ds_file else None,
            accelerator_config={"use_configured_state": True},
        )
    return kwargs


def _deepspeed_process_group() -> None:
    """Create accelerate's state on gloo while DeepSpeed is flagged, before TrainingArguments exist."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def after_accelerator(trainer: Any) -> None:
    """FSDP rehearsal: switch the MULTI_CPU accelerator state to FSDP with the Trainer's own plugin."""
    if rehearsal_backend() != "fsdp" or trainer.is_fsdp_enabled:
        return
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from accelerate import PartialState

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    # AcceleratorState copies the distributed type from PartialState whenever accelerate makes one again
    # (preparing the optimizer and scheduler, syncing RNG state): switch it there too, or it reverts to MULTI_CPU
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def fix_bnb_4bit(model: Any) -> None:
    """Keep bitsandbytes from repacking 4-bit weights for CPU inference (it breaks training afterwards)."""
    if not on_cpu():
        return
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def keep_freed_memory(device: Any) -> str | None:
    """Pin glibc malloc's mmap and trim thresholds for a process that trains on the CPU (see the module
    docstring); returns what it did, for the run's speed log, or None where nothing changed (a GPU, another
    C library). Process-wide, and set before the speed probe, which times steps as training runs them."""
    if getattr(device, "type", device) != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return f"memory: freed blocks up to {MMAP_THRESHOLD >> 20} MB kept for reuse (glibc malloc, CPU training)"
