"""The Trainer, its callbacks and their order, made in one function (`build_trainer`), read top to bottom.

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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hftrain.checkpoint import elastic
from hftrain.checkpoint.manager import CheckpointManager, KeptCheckpointsCallback
from hftrain.data.loader import collator_for
from hftrain.data.packed_batch import mask_note
from hftrain.integrations import trackers
from hftrain.integrations.outbox import Outbox
from hftrain.parallel.dims import ParallelDims
from hftrain.recipe.parts import TrainerPart
from hftrain.speed.hardware import measure_peak_flops
from hftrain.speed.profiling import ProfilerCallback
from hftrain.training import objectives
from hftrain.training.input_check import InputCheckCallback
from hftrain.training.resumed_settings import ResumedSettings
from hftrain.training.step_faults import NonFiniteGuard, PreemptionCallback, StepFlags
from hftrain.training.step_metrics import MetricsFileCallback, MetricsOptions, StepMetrics, ThroughputClockCallback
from hftrain.training.trainer import HftrainTrainer, TrainerOptions


def build_trainer(
    part: TrainerPart,
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
    """The objective's Trainer (training/objectives.py: TRL's DPOTrainer behind it for finetune.objective dpo) with
    hftrain's data, checkpoints, metrics, guard and callbacks (the module docstring gives their order), and the
    trackers' queues."""
    is_main, section = args.process_index == 0, part.data.section
    collate = collator_for(section, model.config._attn_implementation, tokenizer.eos_token_id)
    if is_main and section.packs_documents:
        print(
            f"hftrain: documents kept apart by {mask_note(collate.kernel, dims.micro_batch, section.seq_len)}",
            flush=True,
        )
    metrics_options = metrics_options_for(part, args, dims)
    metrics = StepMetrics(metrics_options, args.device, is_main, counts_tokens=section.preference_data)
    flags = StepFlags(args.device, args.world_size)
    guard = NonFiniteGuard(part.faults, checkpoints.latest, flags)
    preemption = PreemptionCallback(flags)  # its agreement rides on the guard's one per step
    fixes = elastic.universal_load_fixes(resume, dims.strategy, args.world_size) if resume is not None else None
    resumed = ResumedSettings() if resume is not None else None
    ours = [
        *[fix for fix in (fixes, resumed) if fix is not None],  # each sees the optimizer as loaded, in this order
        MetricsFileCallback(),
        *callbacks,
        InputCheckCallback(metrics_options),
        ThroughputClockCallback(metrics),
        *([KeptCheckpointsCallback(part.kept)] if part.kept.keeps_any else []),
        guard,
        *(
            [ProfilerCallback(part.profile, checkpoints.layout.root, args.process_index)]
            if part.profile.start_step is not None
            else []
        ),
        preemption,
    ]
    options = TrainerOptions(
        dims, part.data, checkpoints, metrics, guard, preemption, part.nan_filter, resume_from=resume, resumed=resumed
    )
    options = replace(options, lr_schedule=part.lr_schedule, schedule_first_step=part.schedule_first_step)
    trainer = objectives.build_trainer(
        part,
        options,
        tokenizer_is_new,
        model=model,
        args=args,
        processing_class=tokenizer,
        data_collator=collate,
        callbacks=ours,
    )
    reporters = trackers.Trackers(trainer, outbox, part.faults.network_timeout_s)
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
