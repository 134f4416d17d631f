"""One training run, start to finish, as named steps:

    resolve (training/resolve.py: reads, changes nothing) -> set up (every side effect: network bound, process
    set-up, speed probe) -> prepare the output directory -> build (model, Trainer) -> fit (train, resuming where a
    checkpoint is) -> finish (final model, results, summary) -> share

`train()` is the single code path behind `hftrain train`, `accelerate launch -m hftrain train` and the Python
API. It resumes an interrupted run in the same output_dir on its own. Each step gets its part of the resolved
RunSpec, never the recipe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain import _compat, network, progress
from hftrain.checkpoint import elastic
from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.integrity import step_of, unreadable
from hftrain.checkpoint.layout import TRAINER_STATE_FILE, RunLayout
from hftrain.checkpoint.manager import CheckpointManager
from hftrain.checkpoint.node_disks import common_resume
from hftrain.checkpoint.output_lock import owning
from hftrain.data.loader import collator_for, first_documents, first_pairs
from hftrain.data.packed_batch import PackedCollator, mask_note
from hftrain.data.preference import SAME_ANSWERS_SAMPLE, same_answers
from hftrain.data.pretokenized import check_compatible
from hftrain.errors import Preempted
from hftrain.integrations import revisions, trackers
from hftrain.integrations.hub import CheckpointPusher
from hftrain.integrations.outbox import Failure, Outbox
from hftrain.model import attention, fused_loss
from hftrain.model.build import build_model
from hftrain.model.finetune import apply_method
from hftrain.model.generation import sample
from hftrain.model.tokenizer import load_tokenizer
from hftrain.parallel import dims as parallel
from hftrain.parallel import liveness
from hftrain.parallel.dims import LaunchEnv, Strategy
from hftrain.speed import fp8
from hftrain.speed.hardware import measure_peak_flops
from hftrain.speed.profiling import ProfilerCallback
from hftrain.training import objectives
from hftrain.training.arguments import TrainingSettings, training_arguments, training_device
from hftrain.training.arguments import set_up as set_up_arguments
from hftrain.training.callbacks import (
    KeptCheckpointsCallback,
    MetricsFileCallback,
    PreemptionCallback,
    StartupOverCallback,
    ThroughputClockCallback,
)
from hftrain.training.input_check import InputCheckCallback
from hftrain.training.nonfinite import NonFiniteGuard
from hftrain.training.objectives import TrainerParts
from hftrain.training.plot import plot_curves
from hftrain.training.resolve import RunSpec, recorded_start, resolve
from hftrain.training.results import build_results, summary
from hftrain.training.run_record import Run
from hftrain.training.step_flags import StepFlags
from hftrain.training.step_metrics import MetricsOptions, StepMetrics
from hftrain.training.trainer import HftrainTrainer, TrainerOptions

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> Run:
    """Run the recipe; `callbacks` are extra transformers TrainerCallbacks (Python API, benchmarks). The run owns
    its output_dir while it trains: a second, independent launch into it is refused (checkpoint/output_lock.py)."""
    progress.start()  # a line at least every few seconds until the first step ends (StartupOverCallback)
    try:
        _compat.quiet_optional_warnings()  # before resolving imports the libraries (a logger level and an import check)
        _compat.skip_unneeded_imports()
        spec = resolve(recipe, LaunchEnv.read(), recorded_start(recipe))  # reads only; refuses before output_dir is touched
        with owning(str(spec.output_dir), "training.output_dir"):
            return run(spec, callbacks)
    finally:
        progress.stop()


def run(spec: RunSpec, callbacks: Sequence[Any]) -> Run:
    """A resolved run: set up -> build -> fit -> finish -> share."""
    if spec.fit_note and spec.launch.rank == 0:  # said at once: before the speed probe measures anything
        print(f"hftrain: {spec.fit_note}", flush=True)
    settings = set_up(spec)
    checkpoints, tokenizer, tokenizer_is_new, resume = prepare_output(spec, settings)
    if settings.args.process_index == 0:
        announce(settings, resume)
    model, collate = build_model_for(spec, settings, tokenizer, tokenizer_is_new)
    trainer = build_trainer(spec, settings, checkpoints, model, tokenizer, collate, resume, callbacks, tokenizer_is_new)
    pusher, reporters = outside_services(spec, trainer)
    pusher.recover()  # what a killed launch of this run queued and did not send
    checkpoints.on_publish.append(pusher.on_checkpoint)
    if resume is None and spec.checkpoints.kept.keeps(0):  # Pythia's step0: the weights before the first step
        initial = checkpoints.save_initial(trainer)
        if initial is not None:
            pusher.on_initial(initial)
    known = {"parameters": spec.shape.counts, "speed": settings.speed.to_json(), "run_length": settings.length.to_json()}  # results.json
    with reporters.session(settings.args):  # the trackers' last reports are sent (or kept as failures) before sharing
        if resume is not None and step_of(resume) >= settings.args.max_steps:
            result = already_finished(trainer, spec, resume, known)
        else:
            if resume is not None:
                elastic.prepare_resume(trainer, resume)  # ZeRO-3 on another process count: universal checkpoint
            fit(trainer, resume)
            result = finish(trainer, spec, known)
    if trainer.args.should_save and checkpoints.layout.final.is_dir():  # the process that saves, once the final model is there
        result.not_shared = share(pusher, checkpoints.layout)
    return result


def set_up(spec: RunSpec) -> TrainingSettings:
    """Every side effect of starting the run, in this order: network time-outs, the process set-up of its dims (a
    CPU rehearsal's backend, DeepSpeed's config path), FP8's refusals (speed/fp8.py, before the probe measures), then
    the TrainingArguments' own (several nodes compare their disks, the speed probe, the processes' agreement;
    training/arguments.py)."""
    network.configure(spec.faults.network_timeout_s)  # every network client from here on answers within this bound
    parallel.prepare_process(spec.dims)
    fp8_setting, device = spec.speed.section.fp8, training_device(spec.arguments, spec.dims)
    fp8.check_here(fp8_setting, device, spec.arguments, spec.finetune.finetune.method, spec.dims.strategy, spec.shape.meta)
    values, speed = set_up_arguments(spec.arguments, spec.dims, spec.shape, spec.speed, spec.recorded, spec.output_dir)
    settings = TrainingSettings(
        training_arguments(values, spec.finetune.finetune, spec.data_section.seq_len), speed, spec.length, spec.dims
    )
    settings.chunked_loss = chunked_loss(spec, settings)
    if settings.chunked_loss:
        why = "eager training on a CPU" if spec.speed.section.loss == "auto" else "speed.loss=chunked"
        settings.speed.reasons.append(f"loss: cross-entropy in chunks, no fp32 copy of all the logits ({why})")
    if fp8_setting:
        settings.speed.reasons.append(fp8.note(spec.shape.meta, fp8_setting))
    return settings


def chunked_loss(spec: RunSpec, settings: TrainingSettings) -> bool:
    """hftrain's chunked cross-entropy where speed.loss says (auto: eager training on a CPU), unless the objective
    computes its own loss head (DPO)."""
    args = settings.args
    return fused_loss.applies(args.device, args.torch_compile, spec.speed.section.loss) and not spec.objective.tiled_loss_head


def prepare_output(spec: RunSpec, settings: TrainingSettings) -> tuple[CheckpointManager, Any, bool, Path | None]:
    """The output directory claimed, the tokenizer, and where the run resumes. The main process prepares the shared
    directory (and trains a tokenizer) before the others read it."""
    args, dims, data = settings.args, spec.dims, spec.data
    checkpoints = CheckpointManager(RunLayout(spec.output_dir), spec.checkpoints, spec.resume, spec.dims)
    with args.main_process_first(desc="preparing the output directory"):
        checkpoints.claim(args.should_save, settings.start_record())  # should_save: each node's first process on node-local disks
        tokenizer, is_new = load_tokenizer(spec.tokenizer, checkpoints.layout.root, lambda n: first_documents(data, n))
        resume = common_resume(checkpoints.resume_point(args.should_save), checkpoints.complete(), dims, unreadable)
    if resume is not None:  # a checkpoint loads only under the backend that wrote it (any process count)
        elastic.check_backend(resume, dims.strategy, dims.processes)
    if data.pretokenized is not None:
        check_compatible(data.manifest, data.pretokenized.pretokenized, spec.data_section.seq_len, tokenizer)
    if spec.data_section.preference_data:  # before the model loads: pairs DPO cannot learn from
        source = spec.data_section.train[0]
        said = same_answers(first_pairs(data, SAME_ANSWERS_SAMPLE), tokenizer, f"data.train ({source.path or source.dataset})")
        if said and args.process_index == 0:
            print(f"hftrain: warning: {said}", flush=True)
    return checkpoints, tokenizer, is_new, resume


def build_model_for(spec: RunSpec, settings: TrainingSettings, tokenizer: Any, tokenizer_is_new: bool) -> tuple[Any, PackedCollator]:
    """The model as this run trains it (its loss, its fine-tuning method, its placement) and the batches' collator."""
    args, dims, section = settings.args, spec.dims, spec.data_section
    model = build_model(spec.model, tokenizer, tokenizer_is_new, dims)
    if spec.speed.section.fp8:
        fp8.apply(model, spec.speed.section.fp8)  # torchao's Float8Linear in the chosen layers (speed/fp8.py)
    collate = collator_for(section, model.config._attn_implementation, tokenizer.eos_token_id)
    if model.config._attn_implementation == "flex_attention":
        _compat.flex_kernel_per_shape()  # CPU: each shape its own compiled kernel (_compat.py)
    if args.process_index == 0 and section.packs_documents:
        print(f"hftrain: documents kept apart by {mask_note(collate.kernel, dims.micro_batch, section.seq_len)}", flush=True)
    plain_blocks = not (section.masks_documents or section.preference_data)  # no position ids, no padding
    if attention.applies(model.config._attn_implementation, model.config.model_type, not plain_blocks):
        attention.use(model)  # SDPA with is_causal and no mask (model/attention.py)
    if settings.chunked_loss:
        fused_loss.use(model)  # fewer passes over the logits (fused_loss.py)
    if not spec.objective.wraps_adapter:  # DPO: TRL wraps the adapter itself (training/preference.py)
        model = apply_method(model, spec.finetune, args.gradient_checkpointing)
    if dims.strategy is Strategy.DEVICE_MAP:
        model = parallel.spread_over_devices(model, spec.max_memory)
    return model, collate


def announce(settings: TrainingSettings, resume: Path | None) -> None:
    """What the run decided before building anything: its length, its speed levers and where it resumes."""
    print(f"hftrain: {settings.length.note}", flush=True)
    if settings.speed.reasons:
        print(f"hftrain: speed defaults: {'; '.join(settings.speed.reasons)}", flush=True)
    if resume is not None:
        print(f"hftrain: resuming from {resume}")


def outside_services(spec: RunSpec, trainer: HftrainTrainer) -> tuple[CheckpointPusher, trackers.Trackers]:
    """What shares the run's checkpoints and what reports its metrics, both through the run's outbox: a service
    that is down never stops or slows training (outbox.py, trackers.py)."""
    args = trainer.args
    outbox = Outbox(Path(args.output_dir), owner=args.should_save)
    reporters = trackers.Trackers(trainer, outbox, spec.faults.network_timeout_s)
    publish, push = spec.publish, spec.push_to_hub
    pusher = CheckpointPusher(publish, args, push, outbox, revisions.publisher(publish, args, push, outbox))
    return pusher, reporters


def build_trainer(
    spec: RunSpec,
    settings: TrainingSettings,
    checkpoints: CheckpointManager,
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
    metrics = StepMetrics(metrics_options(spec, settings), args.device, args.process_index == 0)
    options = TrainerOptions(
        dims=settings.dims,
        data=spec.data,
        checkpoints=checkpoints,
        metrics=metrics,
        guard=NonFiniteGuard(spec.faults, checkpoints.latest, StepFlags(args.device, args.world_size)),
        resume_from=resume,
    )
    callbacks = [
        MetricsFileCallback(),
        *callbacks,
        InputCheckCallback(metrics.options),  # before step 1 on a GPU, before the clock starts: does the input keep up?
        ThroughputClockCallback(metrics),
        StartupOverCallback(),
        KeptCheckpointsCallback(spec.checkpoints.kept.keeps),
    ]
    parts = TrainerParts(spec.trainer, options, model, args, tokenizer, collate, callbacks, tokenizer_is_new)
    trainer = objectives.build_trainer(spec.objective.name, parts)  # its own Trainer per objective
    if spec.profile.start_step is not None:
        trainer.add_callback(ProfilerCallback(spec.profile, checkpoints.layout.root, args.process_index))
    return trainer


def metrics_options(spec: RunSpec, settings: TrainingSettings) -> MetricsOptions:
    """The fixed numbers of the step metrics; the MFU peak is the recipe's, else measured here now."""
    args, monitor = settings.args, spec.monitor
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = monitor.peak_tflops * 1e12 if monitor.peak_tflops else measure_peak_flops(args.device, peak_dtype)
    return MetricsOptions(
        tokens_per_step=settings.dims.global_batch * spec.data_section.seq_len,
        world_size=args.world_size,
        flops_per_token=spec.shape.flops_per_token,
        peak_flops=peak,
        price_per_hour=monitor.price_per_hour,
        input_bound_threshold=monitor.input_bound_threshold,
        dataloader_workers=args.dataloader_num_workers,
    )


def fit(trainer: HftrainTrainer, resume: Path | None) -> None:
    """Train to max_steps; a SIGTERM / SIGUSR1 saves a checkpoint at the next step and stops (Preempted)."""
    preemption, dims = PreemptionCallback(trainer.options.guard.flags), trainer.options.dims  # one agreement per step
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


def already_finished(trainer: HftrainTrainer, spec: RunSpec, resume: Path, known: dict[str, Any]) -> Run:
    """The checkpoint is at max_steps: nothing to train (the Trainer would still take one more step)."""
    from transformers.trainer_callback import TrainerState

    print(f"hftrain: {resume} is already at training.max_steps={trainer.args.max_steps}; nothing to train (raise max_steps to continue).")
    trainer.state = TrainerState.load_from_json(str(resume / TRAINER_STATE_FILE))
    layout = trainer.options.checkpoints.layout
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # sharded weights load only inside train()
        metrics = read_json(layout.results, "the run's results") if layout.results.is_file() else {}
        return Run(spec.as_run, layout.root, layout.final, trainer, metrics=metrics)
    trainer.options.checkpoints.load_weights(trainer.model, resume)
    return finish(trainer, spec, known)


def finish(trainer: HftrainTrainer, spec: RunSpec, known: dict[str, Any]) -> Run:
    """Save the final model, evaluate it, write the results, plot and summary. `known`: what results.json records
    from the run's start (parameters, speed choices with their measurements)."""
    checkpoints = trainer.options.checkpoints
    layout = checkpoints.layout
    staged = checkpoints.stage_final(trainer)
    metrics = trainer.evaluate()
    run, monitor = Run(spec.as_run, layout.root, layout.final, trainer, metrics=metrics), spec.monitor
    if not trainer.args.should_save:
        return run
    checkpoints.publish_final(staged, {"step": trainer.state.global_step, "eval_loss": metrics["eval_loss"]})
    results = build_results(trainer.state.global_step, metrics, run.log_history, {**run_facts(trainer), **known})
    if monitor.sample_max_new_tokens:
        run.sample = results["sample"] = sample(run.model, trainer.processing_class, monitor.sample_prompt, monitor.sample_max_new_tokens)
    if monitor.plot:
        run.plot_path = plot_curves(run.log_history, layout.plot, title=str(layout.root))
    layout.results.write_text(json.dumps(results, indent=2), encoding="utf-8")
    lines = summary(results, layout.final, monitor.input_bound_threshold, trainer.args.dataloader_num_workers)
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
    pusher.outbox.settle()  # what was owed is sent or written down: the journal goes
    return failures
