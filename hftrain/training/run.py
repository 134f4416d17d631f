"""One training run, start to finish, as named steps:

    measure the model -> parallel dims (parallel/dims.py) -> TrainingArguments -> output dir + tokenizer -> model -> Trainer
           -> train (resuming where a checkpoint is) -> final model -> results + summary -> share

`train()` is the single code path behind `hftrain train`, `accelerate launch -m hftrain train` and the
Python API. It resumes an interrupted run in the same output_dir on its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch

from hftrain import _compat
from hftrain.checkpoint import elastic
from hftrain.model import fused_loss
from hftrain.parallel import dims as parallel
from hftrain import network
from hftrain.integrations import revisions, trackers
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.training import objectives
from hftrain.training.objectives import TrainerParts
from hftrain.training.arguments import TrainingSettings, training_arguments
from hftrain.training.callbacks import (
    KeptCheckpointsCallback,
    MetricsFileCallback,
    PreemptionCallback,
    StartupOverCallback,
    ThroughputClockCallback,
)
from hftrain.checkpoint.integrity import step_of, unreadable
from hftrain.checkpoint.manager import CheckpointManager
from hftrain.checkpoint.node_disks import common_resume
from hftrain.parallel import liveness
from hftrain.checkpoint.output_lock import owning
from hftrain import progress
from hftrain.data.loader import DataPlan, collator_for, first_documents, plan_data
from hftrain.data.packed_batch import PackedCollator, mask_note
from hftrain.data.pretokenized import check_compatible
from hftrain.errors import Preempted
from hftrain.checkpoint.files import read_json
from hftrain.model.finetune import apply_method, check_starting_weights
from hftrain.model.generation import sample
from hftrain.speed.hardware import measure_peak_flops
from hftrain.integrations.hub import CheckpointPusher
from hftrain.integrations.outbox import Failure, Outbox
from hftrain.checkpoint.layout import TRAINER_STATE_FILE, RunLayout
from hftrain.model.build import ModelShape, build_model, measure_model
from hftrain.training.nonfinite import NonFiniteGuard
from hftrain.parallel.dims import Strategy
from hftrain.training.plot import plot_curves
from hftrain.speed.profiling import ProfilerCallback
from hftrain.recipe.schema import Recipe
from hftrain.training.results import build_results, summary
from hftrain.training.run_record import Run
from hftrain.training.step_metrics import MetricsOptions, StepMetrics
from hftrain.model.tokenizer import load_tokenizer
from hftrain.training.trainer import HftrainTrainer, TrainerOptions


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> Run:
    """Run the recipe; `callbacks` are extra transformers TrainerCallbacks (Python API, benchmarks). The run owns
    its output_dir while it trains: a second, independent launch into it is refused (checkpoint/output_lock.py)."""
    network.configure(recipe.faults.network_timeout_s)  # every network client from here on answers within this bound
    check_starting_weights(recipe)  # before output_dir is touched
    with owning(recipe.training.output_dir, "training.output_dir"):
        progress.start()  # a line at least every few seconds until the first step ends (StartupOverCallback)
        try:
            return _train(recipe, callbacks)
        finally:
            progress.stop()


def _train(recipe: Recipe, callbacks: Sequence[Any]) -> Run:
    _compat.quiet_optional_warnings()
    _compat.skip_unneeded_imports()
    shape = measure_model(recipe)
    layout = RunLayout(Path(recipe.training.output_dir))
    checkpoints = CheckpointManager(layout, recipe, recipe.training.save_total_limit)
    data = plan_data(recipe.data, recipe.training.seed)
    recorded = checkpoints.recorded_start()
    fitted, memory_note = fit_memory(recipe, shape, recorded.get("global_batch"))
    if memory_note and int(os.environ.get("RANK", "0")) == 0:  # said at once: before the speed probe measures anything
        print(f"hftrain: {memory_note}", flush=True)
    if fitted is not recipe:  # parallelism.fit_memory: the micro-batch and checkpointing that fit here
        recipe, checkpoints = fitted, CheckpointManager(layout, fitted, fitted.training.save_total_limit)
    dims = parallel.resolve(recipe, recorded, data.reader_limit)  # once: strategy, processes, batch, readers
    settings = training_arguments(recipe, dims, shape, recorded, data.manifest_tokens)
    args = settings.args
    goal = OBJECTIVES[recipe.finetune.objective]
    chunked_loss = fused_loss.applies(args.device, args.torch_compile) and not goal.tiled_loss_head  # TRL's DPO: its own fused head
    if chunked_loss:
        settings.speed.reasons.append("loss: cross-entropy in cache-sized chunks (eager training on a CPU)")
    # The main process prepares the shared output directory (and trains a tokenizer) before the others read it.
    with args.main_process_first(desc="preparing the output directory"):
        checkpoints.claim(args.should_save, settings.start_record())  # should_save: each node's first process on node-local disks
        tokenizer, tokenizer_is_new = load_tokenizer(recipe, layout.root, lambda n: first_documents(data, n))
        resume = common_resume(checkpoints.resume_point(settings.resume, args.should_save), checkpoints.complete(), dims, unreadable)
    if resume is not None:  # a checkpoint loads only under the backend that wrote it (any process count)
        elastic.check_backend(resume, dims.strategy, dims.processes)
    if args.process_index == 0:
        announce(settings, resume)
    if data.pretokenized is not None:
        check_compatible(data.manifest, data.pretokenized.pretokenized, recipe.data.seq_len, tokenizer)
    model = build_model(recipe, tokenizer, tokenizer_is_new, dims)
    collate = collator_for(recipe.data, model.config._attn_implementation, tokenizer.eos_token_id)
    if args.process_index == 0 and recipe.data.packs_documents:
        print(f"hftrain: documents kept apart by {mask_note(collate.kernel, dims.micro_batch, recipe.data.seq_len)}", flush=True)
    if chunked_loss:
        fused_loss.use(model)  # fewer passes over the logits (fused_loss.py)
    if not goal.wraps_adapter:  # DPO: TRL wraps the adapter itself (training/preference.py)
        model = apply_method(model, recipe, args.gradient_checkpointing)
    if dims.strategy is Strategy.DEVICE_MAP:
        model = parallel.spread_over_devices(model, recipe)
    trainer = build_trainer(recipe, shape, settings, checkpoints, data, model, tokenizer, collate, resume, callbacks, tokenizer_is_new)
    pusher, reporters = outside_services(recipe, settings.push_to_hub, trainer)
    checkpoints.on_publish.append(pusher.on_checkpoint)
    if resume is None and recipe.checkpoints.keeps(0):  # Pythia's step0: the weights before the first step
        initial = checkpoints.save_initial(trainer)
        if initial is not None:
            pusher.on_initial(initial)
    known = {"parameters": shape.counts, "speed": settings.speed.to_json(), "run_length": settings.length.to_json()}  # results.json
    with reporters.session(args):  # the trackers' last reports are sent (or kept as failures) before sharing
        if resume is not None and step_of(resume) >= args.max_steps:
            run = already_finished(trainer, recipe, resume, known)
        else:
            if resume is not None:
                elastic.prepare_resume(trainer, resume)  # ZeRO-3 on another process count: universal checkpoint
            fit(trainer, resume)
            run = finish(trainer, recipe, known)
    if trainer.args.should_save and layout.final.is_dir():  # the process that saves, once the final model is there
        run.not_shared = share(pusher, layout)
    return run


def announce(settings: TrainingSettings, resume: Path | None) -> None:
    """What the run decided before building anything: its length, its speed levers and where it resumes."""
    print(f"hftrain: {settings.length.note}", flush=True)
    if settings.speed.reasons:
        print(f"hftrain: speed defaults: {'; '.join(settings.speed.reasons)}", flush=True)
    if resume is not None:
        print(f"hftrain: resuming from {resume}")


def outside_services(recipe: Recipe, push_to_hub: bool, trainer: HftrainTrainer) -> tuple[CheckpointPusher, trackers.Trackers]:
    """What shares the run's checkpoints and what reports its metrics, both through the run's outbox: a service
    that is down never stops or slows training (outbox.py, trackers.py)."""
    args = trainer.args
    outbox = Outbox(Path(args.output_dir), owner=args.should_save)
    reporters = trackers.Trackers(trainer, outbox, recipe.faults.network_timeout_s)
    pusher = CheckpointPusher(recipe, args, push_to_hub, outbox, revisions.publisher(recipe, args, push_to_hub, outbox))
    return pusher, reporters


def fit_memory(recipe: Recipe, shape: ModelShape, recorded_global: int | None) -> tuple[Recipe, str | None]:
    """parallelism.fit_memory's micro-batch and checkpointing, or a warning when the recipe's will not fit (fit.py);
    a continuing run keeps the global batch it recorded at its start."""
    strategy = parallel.resolve_strategy(recipe)
    if strategy is Strategy.DEVICE_MAP:
        return recipe, None
    from hftrain.parallel import rehearsal
    from hftrain.plan.estimates import plan
    from hftrain.plan.fit import MEMORY_WARNED_ENV, fit_this_run

    processes = parallel.world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    name = "single" if strategy is Strategy.SINGLE else strategy.value
    fitted, note = fit_this_run(
        recipe, plan(recipe, shape), processes, local, name, "cpu" if rehearsal.on_cpu() else "cuda", recorded_global
    )
    if note and not recipe.parallelism.fit_memory and os.environ.get(MEMORY_WARNED_ENV):
        note = None  # `hftrain train --accelerate-config` said it once before starting the processes
    return fitted, note


def build_trainer(
    recipe: Recipe,
    shape: ModelShape,
    settings: TrainingSettings,
    checkpoints: CheckpointManager,
    data: DataPlan,
    model: Any,
    tokenizer: Any,
    collate: PackedCollator,
    resume: Path | None,
    callbacks: Sequence[Any] = (),
    tokenizer_is_new: bool = False,
) -> HftrainTrainer:
    """The Trainer with hftrain's data, checkpoints, metrics, guard and callbacks, as the objective builds it
    (training/objectives.py: TRL's DPOTrainer behind them for finetune.objective dpo)."""
    args = settings.args
    metrics = StepMetrics(metrics_options(recipe, settings, shape), args.device, args.process_index == 0)
    options = TrainerOptions(
        dims=settings.dims,
        data=data,
        checkpoints=checkpoints,
        metrics=metrics,
        guard=NonFiniteGuard(recipe.faults, checkpoints.latest),
        resume_from=resume,
    )
    callbacks = [
        MetricsFileCallback(),
        *callbacks,
        ThroughputClockCallback(metrics),
        StartupOverCallback(),
        KeptCheckpointsCallback(recipe.checkpoints.keeps),
    ]
    parts = TrainerParts(recipe, options, model, args, tokenizer, collate, callbacks, tokenizer_is_new)
    trainer = objectives.build_trainer(recipe.finetune.objective, parts)  # its own Trainer per objective
    if recipe.profile.start_step is not None:
        trainer.add_callback(ProfilerCallback(recipe.profile, checkpoints.layout.root, args.process_index))
    return trainer


def metrics_options(recipe: Recipe, settings: TrainingSettings, shape: ModelShape) -> MetricsOptions:
    """The fixed numbers of the step metrics; the MFU peak is the recipe's, else measured here now."""
    args = settings.args
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = recipe.monitor.peak_tflops * 1e12 if recipe.monitor.peak_tflops else measure_peak_flops(args.device, peak_dtype)
    tokens = settings.dims.global_batch * recipe.data.seq_len
    return MetricsOptions(
        tokens_per_step=tokens,
        world_size=args.world_size,
        flops_per_token=shape.flops_per_token,
        peak_flops=peak,
        price_per_hour=recipe.monitor.price_per_hour,
        input_bound_threshold=recipe.monitor.input_bound_threshold,
        dataloader_workers=args.dataloader_num_workers,
    )


def fit(trainer: HftrainTrainer, resume: Path | None) -> None:
    """Train to max_steps; a SIGTERM / SIGUSR1 saves a checkpoint at the next step and stops (Preempted)."""
    preemption, dims = PreemptionCallback(), trainer.options.dims
    trainer.add_callback(preemption)
    latest = trainer.options.checkpoints.latest
    where = lambda: f"the last complete checkpoint is {latest()}" if latest() else "no checkpoint is complete yet"  # noqa: E731
    heartbeat = liveness.Heartbeat(dims, where)  # a lost or stuck node is named, not a transport error or a hang
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except Exception as failure:
        lost = liveness.lost_peers(dims, failure, where())
        if lost is None:
            raise
        raise lost from None
    finally:
        heartbeat.stop()
        preemption.restore()
    if preemption.step is not None:
        saved = trainer.options.checkpoints.layout.checkpoint(preemption.step)
        raise Preempted(
            f"stopped by {preemption.received} after step {preemption.step}; saved {saved}. "
            "Run the same command again to continue from there."
        )


def already_finished(trainer: HftrainTrainer, recipe: Recipe, resume: Path, known: dict[str, Any]) -> Run:
    """The checkpoint is at max_steps: nothing to train (the Trainer would still take one more step)."""
    from transformers.trainer_callback import TrainerState

    print(f"hftrain: {resume} is already at training.max_steps={trainer.args.max_steps}; nothing to train (raise max_steps to continue).")
    trainer.state = TrainerState.load_from_json(str(resume / TRAINER_STATE_FILE))
    layout = trainer.options.checkpoints.layout
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # sharded weights load only inside train()
        metrics = read_json(layout.results, "the run's results") if layout.results.is_file() else {}
        return Run(recipe, layout.root, layout.final, trainer, metrics=metrics)
    trainer.options.checkpoints.load_weights(trainer.model, resume)
    return finish(trainer, recipe, known)


def finish(trainer: HftrainTrainer, recipe: Recipe, known: dict[str, Any]) -> Run:
    """Save the final model, evaluate it, write the results, plot and summary. `known`: what results.json records
    from the run's start (parameters, speed choices with their measurements)."""
    checkpoints = trainer.options.checkpoints
    layout = checkpoints.layout
    staged = checkpoints.stage_final(trainer)
    metrics = trainer.evaluate()
    run = Run(recipe, layout.root, layout.final, trainer, metrics=metrics)
    if not trainer.args.should_save:
        return run
    checkpoints.publish_final(staged, {"step": trainer.state.global_step, "eval_loss": metrics["eval_loss"]})
    results = build_results(trainer.state.global_step, metrics, run.log_history, {**run_facts(trainer), **known})
    if recipe.monitor.sample_max_new_tokens:
        run.sample = results["sample"] = sample(
            run.model, trainer.processing_class, recipe.monitor.sample_prompt, recipe.monitor.sample_max_new_tokens
        )
    if recipe.monitor.plot:
        run.plot_path = plot_curves(run.log_history, layout.plot, title=str(layout.root))
    layout.results.write_text(json.dumps(results, indent=2), encoding="utf-8")
    lines = summary(results, layout.final, recipe.monitor.input_bound_threshold, trainer.args.dataloader_num_workers)
    lines += [f"plot: {run.plot_path}"] if run.plot_path else []
    lines += [f"sample: {run.sample!r}"] if run.sample else []
    print("\n".join(lines), flush=True)
    return run


def run_facts(trainer: HftrainTrainer) -> dict[str, Any]:
    """What results.json records about how the run ran, beyond its metrics."""
    loader = trainer.train_loader
    skipped = 0 if loader is None else sum(int(p.get("start", {}).get("docs", {}).get("skipped", 0)) for p in loader.positions.values())
    return {
        **trainer.options.metrics.run_split(),
        "bf16": trainer.args.bf16,
        "torch_compile": trainer.args.torch_compile,
        **trainer.distribution,
        "data_records_skipped": skipped,
        "data_readers": trainer.options.dims.readers.readers,
        "shuffle_window": trainer.options.dims.readers.window,
        "packing_fill": None if loader is None or loader.fill is None else round(loader.fill, 4),
        "document_masking": trainer.options.data.section.masks_documents,
    }


def share(pusher: CheckpointPusher, layout: RunLayout) -> list[Failure]:
    """Push the final model where the recipe says (hub, S3) after what the outbox still holds; every failure of the
    run's outside services (each was said when it happened), added to results.json with how to send it later."""
    if pusher.enabled:
        done, failures = pusher.on_end(layout.root, layout.final)
        for target in done:
            print(f"pushed: {target}", flush=True)
    else:
        failures = pusher.outbox.finish()
    if failures and layout.results.is_file():
        results = read_json(layout.results, "the run's results")
        layout.results.write_text(json.dumps({**results, "not_shared": [f.to_json() for f in failures]}, indent=2), encoding="utf-8")
    return failures
