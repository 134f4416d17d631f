"""The recipe's training section -> transformers.TrainingArguments, made once and never changed after.

Each helper returns what it decides (the nodes' disks, FP8's compile, the speed levers measured or kept, the
device's levers); `set_up` merges them over the resolved values in one place and makes the arguments from the
result, so what a checkpoint's training_args.bin records is what ran.

hftrain handles five TrainingArguments keys itself: ``resume_from_checkpoint`` (the CheckpointManager finds
the checkpoint), ``push_to_hub`` (the Trainer's own push would upload output_dir's root; hub.py pushes the
final model), ``save_total_limit`` (rotation happens after a checkpoint is complete, checkpoint/manager.py),
``logging_nan_inf_filter`` (done on the device by hftrain's Trainer, training/trainer.py; the Trainer's own reads
every micro-batch's loss on the host, so its arguments say False), and the data skip on resume (hftrain restores
its data position instead of replaying batches).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments

from hftrain import _compat
from hftrain.checkpoint import node_disks
from hftrain.errors import HftrainError
from hftrain.model import fused_loss
from hftrain.model.part import ModelPart
from hftrain.model.shape import ModelShape
from hftrain.parallel import launcher_store, rehearsal
from hftrain.parallel.dims import ParallelDims
from hftrain.planning.run_length import RunLength
from hftrain.recipe.finetune_section import FinetuneSection
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.speed import defaults as speed
from hftrain.speed import fp8
from hftrain.speed.defaults import SpeedPart, SpeedPlan
from hftrain.training import objectives


def start_record(args: TrainingArguments, dims: ParallelDims) -> dict[str, Any]:
    """What a run records at its start and keeps when it continues (CheckpointManager.recorded_start)."""
    levers = {key: value for key in speed.LEVER_KEYS if (value := getattr(args, key)) is not None}
    readers = dims.readers
    return {
        "speed": levers,
        "global_batch": dims.global_batch,
        "readers": readers.readers,
        "shuffle_window": readers.window,
    }


# read by hftrain (module docstring), not the Trainer
HFTRAIN_KEYS = ("resume_from_checkpoint", "push_to_hub", "save_total_limit")


def argument_values(
    recipe_kwargs: dict[str, Any], dims: ParallelDims, length: RunLength, device: str
) -> dict[str, Any]:
    """The TrainingArguments values for this run's dims and length, before the speed levers (``set_up``). Pure:
    `recipe_kwargs` are the training section's keys; `device` the launch's (cuda | cpu)."""
    kwargs = {key: value for key, value in recipe_kwargs.items() if key not in HFTRAIN_KEYS}
    kwargs.update(gradient_accumulation_steps=dims.accumulation, max_steps=length.max_steps)
    kwargs.setdefault("use_cpu", device == "cpu")
    kwargs.update(ignore_data_skip=True, remove_unused_columns=False)  # batches hold only model inputs
    kwargs.setdefault("ddp_find_unused_parameters", False)
    kwargs["logging_nan_inf_filter"] = False  # hftrain's Trainer filters on the device (module docstring)
    if device == "cuda" and not kwargs["use_cpu"]:
        kwargs.update(non_blocking_copies(kwargs))
    return rehearsal.training_kwargs(kwargs, dims.rehearsal)


def non_blocking_copies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """On CUDA, batches are copied to the device without the host waiting (accelerator_config.non_blocking, which
    hftrain's loader honours as accelerate's does), from pinned memory (dataloader_pin_memory, True by default):
    a blocking copy waits for every kernel queued before it, so the host could not queue the next step ahead. A
    recipe that sets non_blocking, turns pinning off or gives accelerator_config as a file keeps its own."""
    config = kwargs.get("accelerator_config")
    if (
        kwargs.get("dataloader_pin_memory") is False
        or not (config is None or isinstance(config, dict))
        or "non_blocking" in (config or {})
    ):
        return {}
    return {"accelerator_config": {**(config or {}), "non_blocking": True}}


def set_up(
    resolved: Mapping[str, Any],
    dims: ParallelDims,
    shape: ModelShape,
    speed_part: SpeedPart,
    model: ModelPart,
    recorded: Mapping[str, Any],
    output_dir: Path,
) -> tuple[TrainingArguments, SpeedPlan]:
    """The run's TrainingArguments, made once: the values the resolver derived (`resolved`, read-only) and what the
    set-up decides, in this order: FP8's refusals (before the probe measures), whether several nodes share
    training.output_dir (a collective), freed device memory kept cached, FP8's compile, the speed levers (measured by
    the probe and agreed by every process, or kept from the run's start) and the device's own levers, then the loss
    path. Returns them with the speed plan (each lever's reason and measurement, and the loss path)."""
    device = training_device(resolved, dims)
    fp8_setting = speed_part.section.fp8
    fp8.check_here(fp8_setting, device, dict(resolved), model.finetune.method, dims.strategy, shape)
    # several nodes: a shared disk or each its own
    storage = node_disks.storage_settings(dict(resolved), output_dir, dims)
    memory = _compat.keep_freed_memory(device)  # before the speed probe: it times steps as training runs them
    compiled, why = fp8.compile_for(fp8_setting, dict(resolved))  # speed.fp8 with torch_compile unset: on
    plan = speed_defaults(speed_part, {**resolved, **storage, **compiled}, dims, shape, recorded.get("speed"), device)
    values = {**resolved, **storage, **compiled, **plan.values}  # merged once; nothing changes them after
    plan = SpeedPlan({**compiled, **plan.values}, [*why, *plan.reasons, *([memory] if memory else [])], plan.measured)
    # hftrain's chunked cross-entropy where speed.loss says (auto: eager training on a CPU), unless DPO's own head
    choice = speed_part.section.loss
    plan.chunked_loss = (
        fused_loss.applies(device, bool(values.get("torch_compile")), choice) and not model.objective.tiled_loss_head
    )
    if plan.chunked_loss:
        why_chunked = "eager training on a CPU" if choice == "auto" else "speed.loss=chunked"
        plan.reasons.append(f"loss: cross-entropy in chunks, no fp32 copy of all the logits ({why_chunked})")
    if fp8_setting:
        plan.fp8 = fp8_setting
        plan.reasons.append(fp8.note(shape, fp8_setting))
    return training_arguments(values, model.finetune, speed_part.seq_len), plan


def training_arguments(values: dict[str, Any], finetune: FinetuneSection, seq_len: int) -> TrainingArguments:
    """The objective's TrainingArguments (DPO: TRL's DPOConfig) from the complete values."""
    try:
        return objectives.training_arguments(finetune, values, seq_len)
    except (ValueError, TypeError) as err:
        raise HftrainError(f"{OBJECTIVES[finetune.objective].sections}: {err}") from None


def training_device(kwargs: dict[str, Any], dims: ParallelDims) -> torch.device:
    """The device this process trains on."""
    return torch.device("cpu" if kwargs.get("use_cpu") or not torch.cuda.is_available() else f"cuda:{dims.local_rank}")


def speed_defaults(
    part: SpeedPart,
    kwargs: dict[str, Any],
    dims: ParallelDims,
    shape: ModelShape,
    recorded: dict[str, Any] | None,
    device: torch.device,
) -> SpeedPlan:
    """bf16 / fp16 / tf32 / torch_compile / optim where the recipe leaves them unset: as recorded at the run's start
    (a resumed run), else decided by measurement on this device (speed/defaults.py), the same in every process; then
    what the device decides without a measurement (speed.device_levers: TF32 beside bf16, fused AdamW on CUDA).
    `kwargs` (the values so far) are only read; the plan's values are what it decided."""
    facts = speed.DeviceFacts.of(device)
    plan = measured_levers(part, kwargs, dims, shape, recorded, device, facts)
    chosen = set(kwargs) | set(plan.values if recorded is not None else ())  # the recipe's own keys, the run's start
    values, reasons = speed.device_levers(chosen, {**kwargs, **plan.values}, facts)
    return SpeedPlan({**plan.values, **values}, [*plan.reasons, *reasons], plan.measured)


def measured_levers(
    part: SpeedPart,
    kwargs: dict[str, Any],
    dims: ParallelDims,
    shape: ModelShape,
    recorded: dict[str, Any] | None,
    device: torch.device,
    facts: speed.DeviceFacts,
) -> SpeedPlan:
    """The levers the speed probe decides (dtype, compile), or those a continuing run recorded at its start."""
    unset = [key for key in speed.LEVER_KEYS if key not in kwargs]
    if not speed.undecided(kwargs):  # e.g. bf16 and torch_compile set, tf32 not: nothing a measurement would decide
        return speed.SpeedPlan()
    if recorded is not None:  # a continuing run: what it started with, never a new measurement
        kept, notes = speed.kept_here({key: value for key, value in recorded.items() if key in unset}, facts)
        reasons = [f"kept from the run's start: {', '.join(f'{k}={v}' for k, v in kept.items())}"] if kept else []
        return speed.SpeedPlan(values=kept, reasons=reasons + notes)
    decide = lambda: speed.decide_here(part, kwargs, dims.strategy, shape, device).to_json()  # noqa: E731
    decided = launcher_store.agree("speed", decide, dims.rank, dims.processes)
    return speed.SpeedPlan.from_json(decided)
