"""What each step of a run receives (training/run.py): one frozen part per step, built once by the resolver.

A step reads its part and the runtime objects the steps before it made (settings, tokenizer, model, checkpoints),
never the whole resolved run: what a step can depend on is written here, and a newcomer reads one step without
the others' inputs. `scripts/step_view.py` prints these fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.checkpoint.manager import ResumeSetting
from hftrain.data.loader import DataPlan
from hftrain.model.shape import ModelShape
from hftrain.parallel.dims import ParallelDims
from hftrain.planning.run_length import RunLength
from hftrain.recipe.finetune_section import FinetuneSection
from hftrain.recipe.objectives import Objective
from hftrain.recipe.parts import CheckpointPart, FinetunePart, ModelPart, PublishPart, SpeedPart, TokenizerPart, TrainerPart
from hftrain.recipe.sections import CheckpointsSection, FaultsSection, MonitorSection, ProfileSection


@dataclass(frozen=True)
class SetUpPart:
    """set_up: the process set-up of the dims, the network bound, FP8's refusals, the TrainingArguments (the values
    resolved here, completed once by what the set-up measures: training/arguments.py) and the loss path."""

    arguments: Mapping[str, Any]  # TrainingArguments values before the set-up's measurements (read-only)
    dims: ParallelDims
    shape: ModelShape
    speed: SpeedPart
    finetune: FinetuneSection
    objective: Objective
    length: RunLength
    recorded: Mapping[str, Any]  # what a continuing run recorded at its start (its speed levers are kept)
    output_dir: Path
    network_timeout_s: float


@dataclass(frozen=True)
class OutputPart:
    """prepare_output: the output directory claimed, the tokenizer, where the run resumes, and the data checks that
    need the tokenizer (a token folder's tokenizer, preference pairs with the same answers)."""

    output_dir: Path
    checkpoints: CheckpointPart
    resume: ResumeSetting
    tokenizer: TokenizerPart
    data: DataPlan


@dataclass(frozen=True)
class ModelBuildPart:
    """build_model_for: the model as the run trains it (its kernel, loss, FP8 layers, fine-tuning method, placement)
    and the batches' collator."""

    model: ModelPart
    finetune: FinetunePart
    objective: Objective
    data: DataPlan  # its section: packing, document masks, preference pairs
    fp8: Any  # speed.fp8 (None: off)
    max_memory: dict[Any, Any] | None  # parallelism.max_memory (device_map)


@dataclass(frozen=True)
class TrainerBuildPart:
    """build_trainer: the objective's Trainer with hftrain's data, metrics, guard, callbacks and profiler."""

    trainer: TrainerPart
    objective: Objective
    data: DataPlan
    faults: FaultsSection
    kept: CheckpointsSection  # which checkpoints are kept (and pushed as revisions)
    profile: ProfileSection
    monitor: MonitorSection
    flops_per_token: float


@dataclass(frozen=True)
class ServicesPart:
    """outside_services: what shares the checkpoints (Hub, S3, revisions) and what reports the metrics."""

    publish: PublishPart
    push_to_hub: bool
    network_timeout_s: float


@dataclass(frozen=True)
class FinishPart:
    """finish: the final model's sample, plot and summary."""

    monitor: MonitorSection
    parameters: dict[str, int]  # results.json: the model's parameter counts
