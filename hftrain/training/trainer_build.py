"""The Trainer's part of the recipe (`TrainerPart.of`) and the Trainer it builds, with its callbacks and their order,
in one method (`TrainerPart.build`), read top to bottom.

Everything hftrain adds to the Trainer is given at construction: its options (TrainerOptions: the dims, the data
plan, the checkpoints, the step metrics, the non-finite guard, the preemption handler, the evaluation, where it
resumes, the recipe's lr_schedule) and its callbacks, which see each event after transformers' own (the flow, the
progress bar, the trackers training.report_to names), in this order:

1. DeepSpeed's universal-load fixes, when ZeRO-3 resumes a checkpoint of another process count (checkpoint/elastic.py:
   before any other of hftrain's sees the optimizer);
2. a resumed run's settings: the recipe's optimizer settings and schedule over the checkpoint's
   (resumed_settings.py);
3. the metrics file (every log line into metrics.jsonl); 4. the caller's callbacks (Python API, benchmarks);
5. the input check (before step 1 on a GPU: does the input keep up?); 6. the throughput clock;
7. the kept checkpoints (checkpoints.steps, only when it keeps any: no per-step lookup otherwise);
8. the non-finite guard; 9. the profiler (profile section); 10. the preemption handler (SIGTERM, SIGUSR1).

One thing follows construction, here: transformers makes the trackers' callbacks from report_to inside
Trainer.__init__, so they are put behind their queues right after it (integrations/trackers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain.checkpoint import elastic
from hftrain.checkpoint.manager import CheckpointManager, KeptCheckpointsCallback
from hftrain.data.loader import collator_for
from hftrain.data.packed_batch import mask_note
from hftrain.integrations import trackers
from hftrain.integrations.outbox import Outbox
from hftrain.model.part import ModelPart
from hftrain.parallel.dims import ParallelDims
from hftrain.recipe.objectives import Objective
from hftrain.recipe.sections import LrScheduleSection
from hftrain.speed.hardware import measure_peak_flops
from hftrain.speed.profiling import ProfilerCallback
from hftrain.training import objectives
from hftrain.training.input_check import InputCheckCallback
from hftrain.training.resumed_settings import ResumedSettings
from hftrain.training.step_faults import NonFiniteGuard, PreemptionCallback, StepFlags
from hftrain.training.step_metrics import MetricsFileCallback, MetricsOptions, StepMetrics, ThroughputClockCallback
from hftrain.training.trainer import HftrainTrainer, TrainerOptions

if TYPE_CHECKING:
    from hftrain.data.loader import DataPlan
    from hftrain.recipe.schema import Recipe
    from hftrain.recipe.sections import CheckpointsSection, FaultsSection, MonitorSection, ProfileSection


@dataclass(frozen=True)
class TrainerPart:
    """What the Trainer and its callbacks read (here, objectives.py, dpo.py): the run's data plan (the resolver's,
    data/loader.py), the validation set's size for its progress line (data.eval_blocks,
    data.seq_len), training.logging_nan_inf_filter, the monitor section (metrics, evaluation tasks, sample, plot), the
    faults section (the non-finite guard), which checkpoints are kept (the checkpoints section), the profile section,
    the model's part (DPO builds its adapter, or its reference copy, from it), the model's FLOPs per token (the
    MFU), and the lr_schedule section with the step it starts at (data.start_step, where the data section has it:
    a run that continues another at its step N)."""

    data: DataPlan
    monitor: MonitorSection
    faults: FaultsSection
    kept: CheckpointsSection
    profile: ProfileSection
    model: ModelPart
    flops_per_token: float
    nan_filter: bool = True  # training.logging_nan_inf_filter, done on the device (training/arguments.py)
    lr_schedule: LrScheduleSection = field(default_factory=LrScheduleSection)
    schedule_first_step: int = 0

    @classmethod
    def of(cls, recipe: Recipe, data: DataPlan, flops_per_token: float) -> TrainerPart:
        nan_filter = recipe.training.logging_nan_inf_filter is not False
        model = ModelPart.of(recipe)
        return cls(
            data,
            recipe.monitor,
            recipe.faults,
            recipe.checkpoints,
            recipe.profile,
            model,
            flops_per_token,
            nan_filter,
            lr_schedule=recipe.lr_schedule,
            schedule_first_step=recipe.data.start_step or 0,
        )

    @property
    def objective(self) -> Objective:
        return self.model.objective

    @property
    def seq_len(self) -> int:
        return self.data.section.seq_len

    def collator(self, model: Any, tokenizer: Any, micro_batch: int, is_main: bool) -> Any:
        """The batches' collator for the model's attention kernel; packed documents say how they are kept apart."""
        section = self.data.section
        collate = collator_for(section, model.config._attn_implementation, tokenizer.eos_token_id)
        if is_main and section.packs_documents:
            note = mask_note(collate.kernel, micro_batch, section.seq_len)
            print(f"hftrain: documents kept apart by {note}", flush=True)
        return collate

    def step_watch(
        self, args: Any, dims: ParallelDims, checkpoints: CheckpointManager, is_main: bool
    ) -> tuple[MetricsOptions, StepMetrics, NonFiniteGuard, PreemptionCallback]:
        """What watches each step: its metrics, the non-finite guard and the preemption handler, whose agreement
        across processes rides on the guard's one per step (StepFlags)."""
        metrics_options = metrics_options_for(self, args, dims)
        counts_tokens = self.data.section.preference_data
        metrics = StepMetrics(metrics_options, args.device, is_main, counts_tokens=counts_tokens)
        flags = StepFlags(args.device, args.world_size)
        return (
            metrics_options,
            metrics,
            NonFiniteGuard(self.faults, checkpoints.latest, flags),
            PreemptionCallback(flags),
        )

    def build(
        self,
        args: Any,
        dims: ParallelDims,
        model: Any,
        tokenizer: Any,
        tokenizer_is_new: bool,
        checkpoints: CheckpointManager,
        resume: Path | None,
        outbox: Outbox,
        callbacks: Sequence[Any] = (),
    ) -> tuple[HftrainTrainer, trackers.Trackers]:
        """The objective's Trainer (objectives.py: TRL's DPOTrainer behind it for finetune.objective dpo) with hftrain's
        data, checkpoints, metrics, guard and callbacks (in the module docstring's order), and the trackers' queues."""
        is_main = args.process_index == 0
        collate = self.collator(model, tokenizer, dims.micro_batch, is_main)
        metrics_options, metrics, guard, preemption = self.step_watch(args, dims, checkpoints, is_main)
        fixes = elastic.universal_load_fixes(resume, dims.strategy, args.world_size) if resume is not None else None
        resumed = ResumedSettings() if resume is not None else None
        ours = [
            *[fix for fix in (fixes, resumed) if fix is not None],  # each sees the optimizer as loaded, in this order
            MetricsFileCallback(),
            *callbacks,
            InputCheckCallback(metrics_options),
            ThroughputClockCallback(metrics),
            *([KeptCheckpointsCallback(self.kept)] if self.kept.keeps_any else []),
            guard,
            *(
                [ProfilerCallback(self.profile, checkpoints.layout.root, args.process_index)]
                if self.profile.start_step is not None
                else []
            ),
            preemption,
        ]
        options = TrainerOptions(
            dims,
            self.data,
            checkpoints,
            metrics,
            guard,
            preemption,
            self.nan_filter,
            resume_from=resume,
            resumed=resumed,
            lr_schedule=self.lr_schedule,
            schedule_first_step=self.schedule_first_step,
        )
        trainer = objectives.build_trainer(
            self,
            options,
            tokenizer_is_new,
            model=model,
            args=args,
            processing_class=tokenizer,
            data_collator=collate,
            callbacks=ours,
        )
        reporters = trackers.Trackers(trainer, outbox, self.faults.network_timeout_s)
        return trainer, reporters


def metrics_options_for(part: TrainerPart, args: Any, dims: ParallelDims) -> MetricsOptions:
    """The fixed numbers of the step metrics; the MFU peak is the recipe's, else measured here now."""
    monitor = part.monitor
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = monitor.peak_tflops * 1e12 if monitor.peak_tflops else measure_peak_flops(args.device, peak_dtype)
    return MetricsOptions(
        tokens_per_step=dims.global_batch * part.data.section.seq_len,
        world_size=args.world_size,
        flops_per_token=part.flops_per_token,
        peak_flops=peak,
        price_per_hour=monitor.price_per_hour,
        input_bound_threshold=monitor.input_bound_threshold,
        dataloader_workers=args.dataloader_num_workers,
    )
