"""Parallelism: which strategy this process was launched with, whether it matches the recipe, the global
batch, and a check that the run really is distributed the way it claims.

The backend itself (DDP, FSDP, DeepSpeed ZeRO-3) is chosen by the launcher: ``accelerate launch
--config_file accelerate_configs/X.yaml`` (or torchrun), or hftrain's own CPU launcher (cpu_compat.py).
``resolve_launch`` reads it once per run into a ``Launch`` that is passed on (model loading, fine-tuning,
speed defaults, the Trainer). Never report FSDP while running DDP: ``verify`` compares accelerate's real
state with the strategy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import cpu_compat
from .errors import HftrainError
from .recipe_schema import Recipe

LABELS = {"single": "single", "ddp": "DDP", "fsdp": "FSDP", "zero3": "ZeRO-3", "device_map": "device_map"}


@dataclass(frozen=True)
class Launch:
    """How this process was started, resolved once per run (``resolve_launch``) and passed on."""

    strategy: str  # single | ddp | fsdp | zero3 | device_map
    world_size: int
    local_rank: int
    rehearsal: str | None  # the backend of a CPU rehearsal (cpu_compat.py); None on GPUs and plain launches

    @property
    def label(self) -> str:
        return LABELS[self.strategy]


def resolve_launch(recipe: Recipe) -> Launch:
    """The run's launch, checked against the recipe; a CPU rehearsal's process set-up happens here, once."""
    launch = Launch(resolve_strategy(recipe), world_size(), int(os.environ.get("LOCAL_RANK", "0")), cpu_compat.rehearsal_backend())
    if launch.rehearsal:
        cpu_compat.prepare_process(launch.rehearsal)
    return launch


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_strategy() -> str:
    """What the launcher set up for this process: single, ddp, fsdp or zero3."""
    rehearsal = cpu_compat.rehearsal_backend()
    if rehearsal:
        return rehearsal
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "zero3"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return "ddp" if world_size() > 1 else "single"


def resolve_strategy(recipe: Recipe) -> str:
    """The run's strategy: the launch's, checked against parallelism.strategy."""
    wanted, launched = recipe.parallelism.strategy, launched_strategy()
    if wanted == "device_map":
        if world_size() > 1:
            raise HftrainError(
                f"parallelism.strategy: device_map spreads one model over the devices of ONE process, but this run "
                f"has {world_size()} processes. Run it with plain `hftrain train RECIPE`, or choose ddp/fsdp/zero3 "
                "for multi-process training (device_map cannot be combined with them)."
            )
        return "device_map"
    if wanted in ("auto", launched):
        return launched
    how = {
        "single": "plain `hftrain train RECIPE`",
        "ddp": "`accelerate launch --config_file accelerate_configs/ddp.yaml -m hftrain train RECIPE` (or `hftrain train RECIPE --accelerate-config ddp`)",
        "fsdp": "`accelerate launch --config_file accelerate_configs/fsdp.yaml -m hftrain train RECIPE` (or `hftrain train RECIPE --accelerate-config fsdp`)",
        "zero3": "`accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml -m hftrain train RECIPE` (or `hftrain train RECIPE --accelerate-config zero3`)",
    }[wanted]
    raise HftrainError(
        f"parallelism.strategy: the recipe asks for {LABELS[wanted]}, but this process was launched as "
        f"{LABELS[launched]} ({world_size()} process(es)). Launch it with {how}, or set parallelism.strategy=auto."
    )


def batch_kwargs(recipe: Recipe, kwargs: dict[str, Any], processes: int, recorded: int | None = None) -> dict[str, Any]:
    """Derive gradient accumulation from the global batch: parallelism.global_batch_size, else the one `recorded`
    at a resumed run's start (so that a run continued on another process count keeps its sequences per step).
    Refuse what does not divide, naming the process counts that would."""
    total = recipe.parallelism.global_batch_size or recorded
    if total is None:
        return kwargs
    micro = kwargs.get("per_device_train_batch_size", 8)
    per_step = micro * processes
    if total % per_step:
        fits = [p for p in range(1, total // micro + 1) if total % (micro * p) == 0]
        what = (f"{total} sequences" if recipe.parallelism.global_batch_size else
                f"this run started with {total} sequences per step (recorded in its hftrain_run.json), which")  # fmt: skip
        raise HftrainError(
            f"parallelism.global_batch_size: {what} cannot be split into micro-batches of {micro} "
            f"(training.per_device_train_batch_size) on {processes} process(es); it must be a multiple of {per_step}. "
            f"With that micro-batch, {', '.join(map(str, fits)) or 'no'} process count(s) work; or change the micro-batch. "
            "(Results do not depend on the device count only while the global batch stays the same.)"
        )
    accumulation = total // per_step
    given = kwargs.get("gradient_accumulation_steps")
    if given not in (None, accumulation) and "gradient_accumulation_steps" in recipe.training.model_fields_set:
        if recipe.parallelism.global_batch_size:
            raise HftrainError(
                f"training.gradient_accumulation_steps: {given} contradicts parallelism.global_batch_size={total} "
                f"(which needs {accumulation} with {micro} x {processes}); remove one of the two."
            )
        if os.environ.get("RANK", "0") == "0":
            print(f"hftrain: keeping this run's global batch of {total} sequences (recorded at its start): "
                  f"gradient_accumulation_steps {given} -> {accumulation} on {processes} process(es)", flush=True)  # fmt: skip
    kwargs["gradient_accumulation_steps"] = accumulation
    return kwargs


def verify(trainer: Any, strategy: str) -> dict[str, Any]:
    """Check accelerate's real state against the strategy; returns what the run really is."""
    from accelerate.utils import DistributedType

    acc = trainer.accelerator
    real = {"distributed_type": str(acc.distributed_type.value if hasattr(acc.distributed_type, "value") else acc.distributed_type),
            "world_size": acc.num_processes}
    expected_types = {
        "single": {DistributedType.NO},
        "device_map": {DistributedType.NO},
        "ddp": {DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.MULTI_XPU, DistributedType.MULTI_NPU},
        "fsdp": {DistributedType.FSDP},
        "zero3": {DistributedType.DEEPSPEED},
    }[strategy]
    problems = []
    if acc.distributed_type not in expected_types:
        problems.append(f"accelerate set up {real['distributed_type']}")
    if acc.num_processes != world_size():
        problems.append(f"accelerate sees {acc.num_processes} process(es) of {world_size()} launched")
    if strategy == "zero3" and acc.state.deepspeed_plugin.zero_stage != 3:
        problems.append(f"DeepSpeed ZeRO stage is {acc.state.deepspeed_plugin.zero_stage}")
    if problems:
        hint = "Check the accelerate config and launcher (see README, Distributed training)."
        if strategy in ("fsdp", "zero3") and not torch.cuda.is_available():
            hint = (f"accelerate runs {LABELS[strategy]} on GPUs only; on this CPU-only machine rehearse it with "
                    f"`hftrain train RECIPE --accelerate-config {strategy} --nproc 2` (gloo processes).")  # fmt: skip
        raise HftrainError(
            f"parallelism: this run was to be {LABELS[strategy]} with {world_size()} process(es), but "
            f"{'; '.join(problems)}. {hint}"
        )
    return real


def spread_over_devices(model: Any, recipe: Recipe) -> Any:
    """device_map strategy: place layers over the visible devices; refuse disk offload (it would not train)."""
    from accelerate import dispatch_model, infer_auto_device_map

    max_memory = recipe.parallelism.max_memory
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=["GPTNeoXLayer"])
    offloaded = sorted(name for name, where in device_map.items() if where == "disk")
    if offloaded:
        raise HftrainError(
            f"parallelism.max_memory: the model does not fit the devices' budget, so {len(offloaded)} module(s) "
            f"({', '.join(offloaded[:3])}...) would be offloaded to disk, and disk-offloaded parameters do not train. "
            "Raise the budget, add devices, or use fsdp/zero3 with CPU offload."
        )
    on_cpu = sorted(name for name, where in device_map.items() if where == "cpu")
    if on_cpu and any(where not in ("cpu", "disk") for where in device_map.values()):
        raise HftrainError(
            f"parallelism.max_memory: the GPUs' budget holds only part of the model, so {len(on_cpu)} module(s) "
            f"({', '.join(on_cpu[:3])}...) would be placed on the CPU. Beside a GPU, accelerate offloads CPU-placed "
            "layers (their weights live on the meta device between forwards), so they would not train. Raise the GPU "
            "budget, add GPUs, or use fsdp/zero3 with CPU offload."
        )
    devices = set(device_map.values())
    if len(devices) == 1:
        (only,) = devices
        return model.to(f"cuda:{only}" if isinstance(only, int) else only)
    return dispatch_model(model, device_map=device_map)


def shutdown() -> None:
    """Leave the process group cleanly: without it, gloo processes may abort at exit after a good run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def agree(name: str, decide: Callable[[], dict[str, Any]], timeout_s: float = 600.0) -> dict[str, Any]:
    """One decision for every process of the run: rank 0 makes it, the others read it from the launcher's
    key-value store (torchrun's, which accelerate launch uses too). Measured choices such as the speed
    defaults must agree: two DDP ranks in different precisions would train on, silently, with mixed gradients.

    Without that store (one process, or another launcher) every process decides for itself."""
    rank = int(os.environ.get("RANK", "0"))
    store = _launcher_store(timeout_s) if world_size() > 1 else None
    if store is None:
        return decide()
    key = f"hftrain/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        value = decide()
        store.set(key, json.dumps(value))
        return value
    return json.loads(store.get(key))  # waits until rank 0 has decided


def _launcher_store(timeout_s: float) -> Any:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or "MASTER_ADDR" not in os.environ:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s))  # fmt: skip
