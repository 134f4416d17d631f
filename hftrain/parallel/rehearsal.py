"""CPU rehearsals of distributed backends: DDP, FSDP and ZeRO-3 in gloo processes on a machine without a GPU.

Active only when (1) CUDA is absent AND (2) hftrain's own CPU launcher started the process (it sets
``HFTRAIN_CPU_REHEARSAL``). On a GPU machine, or under a plain ``accelerate launch``, nothing here runs:
no forced distributed type, no gloo, no use_cpu. The patches of accelerate and DeepSpeed a rehearsal needs
(and the CPU fixes outside rehearsals) are in hftrain/_compat.py, marked CPU.

What was seen on CPUs with accelerate 1.15 and DeepSpeed 0.19, and what this module does about it:

* ``launch_processes``: accelerate starts ONE process for a ``MULTI_CPU`` config (multi-process CPU means
  mpirun there; accelerate#2741) and never enables FSDP or DeepSpeed for CPU processes. So hftrain starts the
  processes itself with torchrun's launcher, on gloo, with the GPUs hidden (``CUDA_VISIBLE_DEVICES=""``, see
  ``process_env``): `--cpu` on a GPU machine rehearses on CPU as asked instead of silently running DDP on the GPUs.
* ``prepare_process`` (the only side effect, called once when the run's parallel dims are resolved): a ZeRO-3
  rehearsal's process group (``_compat.deepspeed_cpu_process_group``), without DeepSpeed's build of an
  inference-only C++ op (``_compat.skip_shm_comm_build``).
* ``training_kwargs`` (pure): the TrainingArguments a rehearsal needs: gloo, ``use_cpu`` for DDP/FSDP, the
  FSDP plugin options from the accelerate YAML, and for ZeRO-3 ``use_cpu=False`` (use_cpu turns DeepSpeed
  off) with ``use_configured_state`` so the Trainer keeps the state made by ``prepare_process``. That makes a
  ZeRO-3 rehearsal fp32: TrainingArguments refuses bf16 without a GPU unless use_cpu is set, so the speed
  defaults keep fp32 there and ``check_precision`` refuses a recipe's own bf16/fp16 before any process starts.
* ``after_accelerator``: an FSDP rehearsal's accelerator state (``_compat.fsdp_state_for_cpu``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hftrain import _compat
from hftrain.errors import HftrainError
from hftrain.parallel import child_errors

REHEARSAL_ENV = "HFTRAIN_CPU_REHEARSAL"  # ddp | fsdp | zero3
ZERO3_ON_CPU = (
    "a ZeRO-3 rehearsal on CPU trains in fp32: TrainingArguments takes "
    "bf16 without a GPU only with use_cpu, which turns DeepSpeed off"
)
CONFIG_ENV = "HFTRAIN_ACCELERATE_CONFIG"  # the accelerate YAML the rehearsal follows


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def rehearsal_backend() -> str | None:
    """The backend hftrain's CPU launcher started this process for, or None (always None with CUDA)."""
    return os.environ.get(REHEARSAL_ENV) if on_cpu() else None


def process_env(config_path: Path, backend: str, nproc: int) -> dict[str, str]:
    """What a rehearsal's processes get on top of the launcher's environment."""
    env = {"CUDA_VISIBLE_DEVICES": "", REHEARSAL_ENV: backend, CONFIG_ENV: str(config_path.resolve())}  # never the GPUs
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if backend == "zero3":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def launch_processes(
    hftrain_args: list[str],
    config_path: Path,
    backend: str,
    nproc: int,
    nodes: Any = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run `python -m hftrain HFTRAIN_ARGS` in `nproc` gloo processes through torchrun; returns the exit code.
    torchrun's launcher runs in this process, so that a failure is reported once (child_errors.py). `nodes`: this
    node's multinode.NodeGroup (default: one node, a standalone rendezvous on a port torchrun picks itself); `env`:
    more for the processes' environment."""
    from torch.distributed import run as torchrun

    node_args = nodes.torchrun_args(nproc) if nodes is not None else ["--standalone", "--nproc_per_node", str(nproc)]
    args = torchrun.parse_args([*node_args, "-m", "hftrain", *hftrain_args])
    elastic = nodes.elastic_env() if nodes is not None else {}
    return child_errors.launch(
        lambda: torchrun.run(args), {**process_env(config_path, backend, nproc), **elastic, **(env or {})}, args
    )


def prepare_process(backend: str) -> None:
    """The process-wide set-up a rehearsal needs before TrainingArguments exist (ZeRO-3 only)."""
    if backend == "zero3":
        _compat.skip_shm_comm_build()  # before DeepSpeed's communication backend starts (in the process group below)
        _compat.deepspeed_cpu_process_group()


def check_precision(training: dict[str, Any], backend: str) -> None:
    """A recipe's own bf16/fp16 in a CPU rehearsal of ZeRO-3: one message naming the key and the way out, instead of
    TrainingArguments' advice to set use_cpu (which would turn DeepSpeed off)."""
    if backend != "zero3":
        return
    for key in ("bf16", "fp16"):
        if training.get(key):
            raise HftrainError(
                f"training.{key}: true, but {ZERO3_ON_CPU}. Add training.{key}=false to the command line to "
                "rehearse this recipe here; its GPU runs keep it."
            )


def training_kwargs(kwargs: dict[str, Any], backend: str | None) -> dict[str, Any]:
    """TrainingArguments changes for a CPU rehearsal of the backend the accelerate YAML describes."""
    if backend is None:
        return kwargs
    check_precision(kwargs, backend)
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
        ds_file = deepspeed_file_of(config_path)
        kwargs.update(
            use_cpu=False,
            deepspeed=str(ds_file) if ds_file else None,
            accelerator_config={"use_configured_state": True},
        )
    return kwargs


def deepspeed_file_of(config_path: Path) -> Path | None:
    """The DeepSpeed JSON an accelerate YAML names (deepspeed_config.deepspeed_config_file), read relative to the
    YAML's own folder as the shipped configs write it (also what hftrain's GPU launcher gives accelerate,
    launch/processes.py); None when it names none."""
    import yaml

    data = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    name = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    return (config_path.parent / name).resolve() if name else None


def after_accelerator(trainer: Any) -> None:
    """FSDP rehearsal: switch the MULTI_CPU accelerator state to FSDP with the Trainer's own plugin."""
    if rehearsal_backend() == "fsdp":
        _compat.fsdp_state_for_cpu(trainer)
