"""The run's parallel dimensions, resolved once per run (``resolve``) and passed on: the strategy (an enum, with
everything hftrain knows per strategy in one table), processes and nodes, this process's ranks, the micro-batch,
gradient accumulation and the global batch, and the logical data readers.

The backend itself (DDP, FSDP, DeepSpeed ZeRO-3) is chosen by the launcher: ``accelerate launch
--config_file accelerate_configs/X.yaml`` (or torchrun), or hftrain's own CPU launcher (rehearsal.py).
``resolve`` reads it from the environment, once, and checks it against the recipe. Never report FSDP while
running DDP: ``verify`` compares accelerate's real state with the strategy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain import _compat
from hftrain.errors import HftrainError
from hftrain.parallel import rehearsal
from hftrain.parallel.batch import derive_accumulation
from hftrain.parallel.child_errors import ELASTIC_ENV, MEMORY_WARNED_ENV
from hftrain.parallel.readers import ReaderLayout, decide_readers, decide_window
from hftrain.recipe.data_section import DataSection

if TYPE_CHECKING:
    from hftrain.parallel.batch import BatchPart

SHIPPED_CONFIGS = Path(__file__).parents[1] / "accelerate_configs"  # accelerate_configs/ in a checkout links here
DEEPSPEED_FILE_ENV = (
    "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # accelerate launch passes the YAML's deepspeed_config_file on as written
)


class Strategy(str, Enum):
    """How the model and its training state are spread over processes. A str: recorded in checkpoints as its value."""

    SINGLE = "single"
    DDP = "ddp"
    FSDP = "fsdp"
    ZERO3 = "zero3"
    DEVICE_MAP = "device_map"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def label(self) -> str:
        return _FACTS[self.value].label

    @property
    def long_label(self) -> str:
        """As a checkpoint's writer is named ("written by DeepSpeed ZeRO-3")."""
        return _FACTS[self.value].long_label

    @property
    def state_format(self) -> str:
        """The format of a checkpoint's model and optimizer state: full, fsdp or zero3 (loads only under it)."""
        return _FACTS[self.value].state_format

    @property
    def accelerate_config(self) -> str | None:
        """The shipped accelerate config that launches it (``--accelerate-config NAME``), None for one process."""
        return _FACTS[self.value].accelerate_config

    @property
    def how_to_launch(self) -> str:
        name = self.accelerate_config
        if name is None:
            return "plain `hftrain train RECIPE`"
        file = "deepspeed_zero3" if name == "zero3" else name
        return (
            f"`accelerate launch --config_file accelerate_configs/{file}.yaml -m hftrain train RECIPE` "
            f"(or `hftrain train RECIPE --accelerate-config {name}`)"
        )

    @property
    def accelerate_types(self) -> set[str]:
        """accelerate's DistributedType values a process of this strategy runs under."""
        return _FACTS[self.value].accelerate_types

    @classmethod
    def of_accelerate_type(cls, distributed_type: str) -> Strategy | None:
        """The multi-process strategy of an accelerate config's distributed_type (None: not one hftrain launches)."""
        return {"MULTI_GPU": cls.DDP, "MULTI_CPU": cls.DDP, "FSDP": cls.FSDP, "DEEPSPEED": cls.ZERO3}.get(
            distributed_type
        )


@dataclass(frozen=True)
class _StrategyFacts:
    label: str
    long_label: str
    state_format: str
    accelerate_config: str | None
    accelerate_types: set[str]


_MULTI = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU"}
_FACTS = {  # the one table keyed by strategy
    "single": _StrategyFacts("single", "single-process", "full", None, {"NO"}),
    "ddp": _StrategyFacts("DDP", "DDP", "full", "ddp", _MULTI),
    "fsdp": _StrategyFacts("FSDP", "FSDP", "fsdp", "fsdp", {"FSDP"}),
    "zero3": _StrategyFacts("ZeRO-3", "DeepSpeed ZeRO-3", "zero3", "zero3", {"DEEPSPEED"}),
    "device_map": _StrategyFacts("device_map", "device_map", "full", None, {"NO"}),
}


@dataclass(frozen=True)
class ParallelDims:
    """How this run is spread, resolved once per run (``resolve``) and passed on."""

    strategy: Strategy
    processes: int  # the data-parallel world size
    nodes: int
    rank: int
    local_rank: int
    rehearsal: Strategy | None  # the backend of a CPU rehearsal (rehearsal.py); None on GPUs and plain launches
    micro_batch: int  # sequences per process per forward (training.per_device_train_batch_size)
    accumulation: int  # gradient accumulation steps, derived from parallelism.global_batch_size when given
    readers: ReaderLayout  # the run's logical data readers over processes x DataLoader workers

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x processes."""
        return self.micro_batch * self.accumulation * self.processes


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher set up for this process, read from the environment once (``read``) and passed on."""

    processes: int  # WORLD_SIZE
    local_processes: int  # LOCAL_WORLD_SIZE: processes on this node
    rank: int
    local_rank: int
    launched: Strategy  # the backend the launcher started
    rehearsal: Strategy | None  # the backend of a CPU rehearsal (rehearsal.py); None on GPUs and plain launches
    elastic_most_nodes: int | None  # an elastic launch's MAX nodes (--nnodes MIN:MAX), None otherwise
    device: str  # cuda | cpu
    memory_warned: bool = False  # `hftrain train --accelerate-config` said the memory fit's warning before starting it
    cpus: int = (
        1  # CPU cores this process may run on, shared by the node's processes (DataLoader workers come from them)
    )

    @classmethod
    def read(cls) -> LaunchEnv:
        processes = world_size()
        backend = rehearsal.rehearsal_backend()
        elastic = os.environ.get(ELASTIC_ENV)
        return cls(
            processes=processes,
            local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", processes)),
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            launched=launched_strategy(processes),
            rehearsal=Strategy(backend) if backend else None,
            elastic_most_nodes=int(elastic.split(":")[1]) if elastic else None,
            device="cpu" if rehearsal.on_cpu() else "cuda",
            memory_warned=bool(os.environ.get(MEMORY_WARNED_ENV)),
            cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        )


def resolve(
    launch: LaunchEnv,
    strategy: Strategy,
    batch: BatchPart,
    data: DataSection,
    recorded: dict[str, Any] | None = None,
    reader_limit: int | None = None,
    workers: int = 0,
) -> ParallelDims:
    """The run's dims: the launch, the resolved strategy and the batch (after the memory fit). `recorded`: what a
    continuing run recorded at its start (global batch, readers, shuffle window are kept); `reader_limit`: how many
    readers the data can split into; `workers`: training.dataloader_num_workers. Pure: the process set-up that
    follows from the dims is ``prepare_process``."""
    recorded = recorded or {}
    processes = launch.processes
    accumulation = derive_accumulation(batch, launch, recorded.get("global_batch"), announce=launch.rank == 0)
    workers = max(workers, 1)
    count = decide_readers(data.readers, recorded.get("readers"), reader_limit, processes, workers)
    window = decide_window(data.shuffle_window, recorded.get("shuffle_window"), count, data.seq_len)
    return ParallelDims(
        strategy=strategy,
        processes=processes,
        nodes=max(1, processes // max(launch.local_processes, 1)),
        rank=launch.rank,
        local_rank=launch.local_rank,
        rehearsal=launch.rehearsal,
        micro_batch=batch.micro_batch,
        accumulation=accumulation,
        readers=ReaderLayout(count, processes, workers, window),
    )


def prepare_process(dims: ParallelDims) -> None:
    """What this process sets up for its dims, once: a CPU rehearsal's backend (rehearsal.py), DeepSpeed's config
    path, and the collective deprecation warnings of ZeRO-3."""
    if Strategy.ZERO3 in (dims.strategy, dims.rehearsal):
        _compat.quiet_collective_deprecations()
    if dims.rehearsal:
        rehearsal.prepare_process(dims.rehearsal)
    elif dims.strategy is Strategy.ZERO3:
        locate_deepspeed_config()


def locate_deepspeed_config(search: tuple[Path, ...] = (SHIPPED_CONFIGS,)) -> None:
    """The accelerate YAML's deepspeed_config_file, as a path this process can open. DeepSpeed opens it relative to
    the working directory, while the shipped YAMLs name theirs relative to their own folder (deepspeed/zero3.json),
    so that `accelerate launch --config_file .../deepspeed_zero3.yaml` works from any directory and from an
    installed hftrain. A relative path missing from the working directory is looked for in `search`; missing
    everywhere, it is one message instead of accelerate's error from inside TrainingArguments."""
    value = os.environ.get(DEEPSPEED_FILE_ENV, "none")
    if value == "none" or value.lstrip().startswith("{") or Path(value).is_file():
        return  # none, an inline JSON, or a path that opens as it is
    if not value.endswith(".json") and "/" not in value:
        return  # accelerate also takes a base64-encoded config
    found = _deepspeed_file(value, search)
    if found is None:
        raise HftrainError(
            "the accelerate config's deepspeed_config.deepspeed_config_file: "
            f"{value} does not exist (a relative path is "
            f"read from the working directory, {Path.cwd()}). Give its absolute path in the accelerate YAML, or launch "
            "from the directory it is relative to."
        )
    os.environ[DEEPSPEED_FILE_ENV] = str(found.resolve())


def _deepspeed_file(value: str, search: tuple[Path, ...] = (SHIPPED_CONFIGS,)) -> Path | None:
    """A DeepSpeed config path as it opens: as given, else (relative) in one of `search`; None when neither."""
    if Path(value).is_file():
        return Path(value)
    if Path(value).is_absolute():
        return None
    return next((folder / value for folder in search if (folder / value).is_file()), None)


def check_deepspeed_schedule(deepspeed: Any, lr_schedule_type: str | None) -> None:
    """A DeepSpeed config with its own "scheduler" block runs that schedule in place of the Trainer's (transformers
    then never builds one), so the recipe's lr_schedule would be ignored without a word: refused; a config that is
    not JSON is named. `deepspeed`: the arguments' training.deepspeed (a path or a dict), else the launch's
    ACCELERATE_DEEPSPEED_CONFIG_FILE."""
    import json

    given = deepspeed if deepspeed is not None else os.environ.get(DEEPSPEED_FILE_ENV)
    where, text = "training.deepspeed" if deepspeed is not None else DEEPSPEED_FILE_ENV, None
    if isinstance(given, (str, Path)) and str(given).lstrip().startswith("{"):
        text = str(given)
    elif isinstance(given, (str, Path)) and str(given) != "none":
        path = _deepspeed_file(str(given))
        if path is None:
            return  # not a file here: locate_deepspeed_config names it; accelerate reads other forms
        where, text = str(path), path.read_text(encoding="utf-8")
    try:
        config = json.loads(text) if text is not None else given
    except json.JSONDecodeError as err:
        raise HftrainError(
            f"the DeepSpeed config {where}: not JSON (line {err.lineno}, column {err.colno}: {err.msg})."
        ) from None
    if lr_schedule_type is not None and isinstance(config, dict) and "scheduler" in config:
        kind = (config["scheduler"] or {}).get("type", "its own")
        raise HftrainError(
            f'lr_schedule.type {lr_schedule_type}: the DeepSpeed config {where} has a "scheduler" block ({kind}), '
            "which DeepSpeed runs in place of the recipe's schedule. Remove the block to train on lr_schedule, or "
            "remove lr_schedule.type to train on DeepSpeed's."
        )


def world_size() -> int:
    """The launcher's process count (WORLD_SIZE); read here alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_strategy(processes: int) -> Strategy:
    """What the launcher set up for this process."""
    backend = rehearsal.rehearsal_backend()
    if backend:
        return Strategy(backend)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return Strategy.ZERO3
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return Strategy.FSDP
    return Strategy.DDP if processes > 1 else Strategy.SINGLE


def resolve_strategy(wanted: str, launch: LaunchEnv) -> Strategy:
    """The run's strategy: the launch's, checked against parallelism.strategy (`wanted`)."""
    processes, launched = launch.processes, launch.launched
    if wanted == "device_map":
        if processes > 1:
            raise HftrainError(
                f"parallelism.strategy: device_map spreads one model over the devices of ONE process, but this run "
                f"has {processes} processes. Run it with plain `hftrain train RECIPE`, or choose ddp/fsdp/zero3 "
                "for multi-process training (device_map cannot be combined with them)."
            )
        return Strategy.DEVICE_MAP
    if wanted in ("auto", launched.value):
        return launched
    raise HftrainError(
        f"parallelism.strategy: the recipe asks for {Strategy(wanted).label}, but this process was launched as "
        f"{launched.label} ({processes} process(es)). Launch it with {Strategy(wanted).how_to_launch}, or set "
        "parallelism.strategy=auto."
    )


def verify(trainer: Any, dims: ParallelDims) -> dict[str, Any]:
    """Check accelerate's real state against the run's dims; returns what the run really is."""
    acc, strategy = trainer.accelerator, dims.strategy
    kind = str(acc.distributed_type.value if hasattr(acc.distributed_type, "value") else acc.distributed_type)
    real = {"distributed_type": kind, "world_size": acc.num_processes}
    problems = []
    if kind not in strategy.accelerate_types:
        problems.append(f"accelerate set up {kind}")
    if acc.num_processes != dims.processes:
        problems.append(f"accelerate sees {acc.num_processes} process(es) of {dims.processes} launched")
    if strategy is Strategy.ZERO3 and acc.state.deepspeed_plugin.zero_stage != 3:
        problems.append(f"DeepSpeed ZeRO stage is {acc.state.deepspeed_plugin.zero_stage}")
    if problems:
        hint = "Check the accelerate config and launcher (see docs/distributed.md)."
        if strategy in (Strategy.FSDP, Strategy.ZERO3) and not torch.cuda.is_available():
            hint = (
                f"accelerate runs {strategy.label} on GPUs only; on this CPU-only machine rehearse it with "
                f"`hftrain train RECIPE --accelerate-config {strategy.value} --nproc 2` (gloo processes)."
            )
        raise HftrainError(
            f"parallelism: this run was to be {strategy.label} with {dims.processes} process(es), but "
            f"{'; '.join(problems)}. {hint}"
        )
    return real


def spread_over_devices(model: Any, max_memory: dict[Any, Any] | None) -> Any:
    """device_map strategy: place layers over the visible devices within parallelism.max_memory; refuse disk offload
    (it would not train)."""
    from accelerate import dispatch_model, infer_auto_device_map

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
