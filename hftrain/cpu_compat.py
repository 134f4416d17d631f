"""Everything hftrain does differently to rehearse distributed backends on CPUs, in one place.

Active only when (1) CUDA is absent AND (2) hftrain's own CPU launcher started the process (it sets
``HFTRAIN_CPU_REHEARSAL``). On a GPU machine, or under a plain ``accelerate launch``, nothing here runs:
no forced distributed type, no gloo, no use_cpu.

Why it exists (accelerate 1.15, DeepSpeed 0.19, see shared/notes/cpu-stack.md):
* accelerate starts ONE process for a MULTI_CPU config and never enables FSDP or DeepSpeed for CPU
  processes; so hftrain starts the processes itself with torchrun (gloo) -> ``launch_processes``;
* FSDP: the Accelerator comes up as MULTI_CPU (plain DDP); its state is switched to FSDP with the plugin
  the Trainer built from TrainingArguments -> ``after_accelerator``;
* bitsandbytes 4-bit on an avx512_bf16 CPU: any no-grad forward repacks Linear4bit weights for CPU
  inference, and training afterwards fails; turning that repacking off fixes it -> ``fix_bnb_4bit``
  (this one is needed in any CPU process, rehearsal or not; it is still a no-op with CUDA);
* DeepSpeed: needs DS_ACCELERATOR=cpu, the process group created with gloo *before* TrainingArguments
  (accelerate state created while ACCELERATE_USE_DEEPSPEED is set), and ``use_configured_state``
  -> ``training_kwargs``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REHEARSAL_ENV = "HFTRAIN_CPU_REHEARSAL"  # ddp | fsdp | zero3
CONFIG_ENV = "HFTRAIN_ACCELERATE_CONFIG"  # the accelerate YAML the rehearsal follows


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def rehearsal_backend() -> str | None:
    """The backend hftrain's CPU launcher started this process for, or None (always None with CUDA)."""
    return os.environ.get(REHEARSAL_ENV) if on_cpu() else None


def launch_processes(hftrain_args: list[str], config_path: Path, backend: str, nproc: int) -> int:
    """Run `python -m hftrain HFTRAIN_ARGS` in `nproc` gloo processes through torchrun; returns its exit code."""
    env = dict(os.environ)
    env[REHEARSAL_ENV] = backend
    env[CONFIG_ENV] = str(config_path.resolve())
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if backend == "zero3":
        env["DS_ACCELERATOR"] = "cpu"
    # --standalone: a local c10d rendezvous on a port torchrun picks itself (no free-port race)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "hftrain", *hftrain_args]
    return subprocess.call(cmd, env=env)


def training_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """TrainingArguments changes for a CPU rehearsal of the backend the accelerate YAML describes."""
    backend = rehearsal_backend()
    if backend is None:
        return kwargs
    import yaml

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
        _deepspeed_process_group()
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

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def fix_bnb_4bit(model: Any) -> None:
    """Keep bitsandbytes from repacking 4-bit weights for CPU inference (it breaks training afterwards)."""
    if not on_cpu():
        return
    for module in model.modules():
        if type(module).__name__ == "Linear4bit" and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
