"""One training run, start to finish, as named steps:

    resolve (training/resolve.py: reads, changes nothing) -> set up (every side effect: network bound, process
    set-up, speed probe) -> prepare the output directory -> build (model, Trainer) -> fit (train, resuming where a
    checkpoint is) -> finish (final model, results, summary) -> share

`train()` is the single code path behind `hftrain train`, `accelerate launch -m hftrain train` and the Python
API. It resumes an interrupted run in the same output_dir on its own. Each step gets its part of the resolved
RunSpec (training/run_parts.py), never the recipe, and the objects the steps before it made.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain import _compat, network, progress
from hftrain.checkpoint import elastic
from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.integrity import step_of, unreadable
from hftrain.checkpoint.layout import TRAINER_STATE_FILE, RunLayout
from hftrain.checkpoint.manager import CheckpointManager, KeptCheckpointsCallback
from hftrain.checkpoint.node_disks import common_resume
from hftrain.checkpoint.output_lock import owning
from hftrain.data.loader import DataPlan, collator_for, first_documents, first_pairs
from hftrain.data.packed_batch import PackedCollator, mask_note
from hftrain.data.preference_pairs import SAME_ANSWERS_SAMPLE, same_answers
from hftrain.data.token_folder import check_tokenizer
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
from hftrain.parallel.dims import LaunchEnv, ParallelDims, Strategy
from hftrain.speed import fp8
from hftrain.speed.hardware import measure_peak_flops
from hftrain.speed.profiling import ProfilerCallback
from hftrain.training import objectives
from hftrain.training.arguments import TrainingSettings, training_device
from hftrain.training.arguments import set_up as set_up_arguments
from hftrain.training.input_check import InputCheckCallback
from hftrain.training.objectives import TrainerParts
from hftrain.training.plot import plot_curves
from hftrain.training.resolve import RunSpec, recorded_start, resolve
from hftrain.training.results import build_results, summary
from hftrain.training.run_parts import FinishPart, ModelBuildPart, OutputPart, ServicesPart, SetUpPart, TrainerBuildPart
from hftrain.training.run_record import AsRun, Run
from hftrain.training.step_faults import NonFiniteGuard, PreemptionCallback, StepFlags
from hftrain.training.step_metrics import MetricsFileCallback, MetricsOptions, StepMetrics, ThroughputClockCallback
from hftrain.training.trainer import HftrainTrainer, TrainerOptions

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> Run:
    """Run the recipe; `callbacks` are extra transformers TrainerCallbacks (Python API, benchmarks). The run owns
    its output_dir while it trains: a second, independent launch into it is refused (checkpoint/output_lock.py)."""
    progress.start()  # a line at least every few seconds until the first step ends (StepMetrics.step_done)
    try:
        _compat.quiet_optional_warnings()  # before resolving imports the libraries (a logger level and an import check)
        _compat.skip_unneeded_imports()
        spec = resolve(recipe, LaunchEnv.read(), recorded_start(recipe))  # reads only; refuses before output_dir is touched
        with owning(str(spec.output.output_dir), "training.output_dir"):
            return run(spec, callbacks)
    finally:
        progress.stop()


def run(spec: RunSpec, callbacks: Sequence[Any]) -> Run:
    """A resolved run: set up -> build -> fit -> finish -> share. Each step receives its part of the spec
    (training/run_parts.py) and the objects the steps before it made."""
    if spec.fit_note and spec.launch.rank == 0:  # said at once: before the speed probe measures anything
        print(f"hftrain: {spec.fit_note}", flush=True)
    settings = set_up(spec.set_up)
    args = settings.args
    checkpoints, tokenizer, tokenizer_is_new, resume = prepare_output(spec.output, settings)
    if args.process_index == 0:
        announce(settings, resume)
    model, collate = build_model_for(spec.model, settings, tokenizer, tokenizer_is_new)
    metrics = StepMetrics(metrics_options(spec.trainer, settings), args.device, args.process_index == 0)
    guard = NonFiniteGuard(spec.trainer.faults, checkpoints.latest, StepFlags(args.device, args.world_size))
    built = TrainerInputs(model, tokenizer, tokenizer_is_new, collate, checkpoints, metrics, guard, resume)
    trainer = build_trainer(spec.trainer, settings, built, callbacks)
    pusher, reporters = outside_services(spec.services, trainer)
    pusher.recover()  # what a killed launch of this run queued and did not send
    checkpoints.on_publish.append(pusher.on_checkpoint)
    if resume is None and spec.trainer.kept.keeps(0):  # Pythia's step0: the weights before the first step
        initial = checkpoints.save_initial(trainer)
        if initial is not None:
            pusher.on_initial(initial)
    known = {"parameters": spec.finish.parameters, "speed": settings.speed.to_json(), "run_length": settings.length.to_json()}
    done = Finishing(spec.finish, spec.as_run, checkpoints, known, run_facts(trainer, metrics, settings.dims, spec.trainer.data))
    with reporters.session(args):  # the trackers' last reports are sent (or kept as failures) before sharing
        if resume is not None and step_of(resume) >= args.max_steps:
            result = already_finished(trainer, done, resume)
        else:
            if resume is not None:
                elastic.prepare_resume(trainer, resume)  # ZeRO-3 on another process count: universal checkpoint
            fit(trainer, resume, guard.flags, settings.dims, checkpoints)
            result = finish(trainer, done)
    if args.should_save and checkpoints.layout.final.is_dir():  # the process that saves, once the final model is there
        result.not_shared = share(pusher, checkpoints.layout)
    return result


def set_up(part: SetUpPart) -> TrainingSettings:
    """Every side effect of starting the run, in this order: network time-outs, the process set-up of its dims (a
    CPU rehearsal's backend, DeepSpeed's config path), FP8's refusals (speed/fp8.py, before the probe measures), then
    the TrainingArguments, made once from the resolved values and what the set-up measures (several nodes compare
    their disks, the speed probe, the processes' agreement; training/arguments.py), and the loss path."""
    network.configure(part.network_timeout_s)  # every network client from here on answers within this bound
    parallel.prepare_process(part.dims)
    fp8_setting, device = part.speed.section.fp8, training_device(part.arguments, part.dims)
    fp8.check_here(fp8_setting, device, part.arguments, part.finetune.method, part.dims.strategy, part.shape)
    args, speed = set_up_arguments(part.arguments, part.dims, part.shape, part.speed, part.recorded, part.output_dir, part.finetune)
    # hftrain's chunked cross-entropy where speed.loss says (auto: eager training on a CPU), unless DPO's own head
    chunked = fused_loss.applies(args.device, args.torch_compile, part.speed.section.loss) and not part.objective.tiled_loss_head
    if chunked:
        why = "eager training on a CPU" if part.speed.section.loss == "auto" else "speed.loss=chunked"
        speed.reasons.append(f"loss: cross-entropy in chunks, no fp32 copy of all the logits ({why})")
    if fp8_setting:
        speed.reasons.append(fp8.note(part.shape, fp8_setting))
    return TrainingSettings(args, speed, part.length, part.dims, chunked)


def prepare_output(part: OutputPart, settings: TrainingSettings) -> tuple[CheckpointManager, Any, bool, Path | None]:
    """The output directory claimed, the tokenizer, and where the run resumes. The main process prepares the shared
    directory (and trains a tokenizer) before the others read it."""
    args, dims, data = settings.args, settings.dims, part.data
    checkpoints = CheckpointManager(RunLayout(part.output_dir), part.checkpoints, part.resume, dims)
    with args.main_process_first(desc="preparing the output directory"):
        checkpoints.claim(args.should_save, settings.start_record())  # should_save: each node's first process on node-local disks
        tokenizer, is_new = load_tokenizer(part.tokenizer, checkpoints.layout.root, lambda n: first_documents(data, n))
        resume = common_resume(checkpoints.resume_point(args.should_save), checkpoints.complete(), dims, unreadable)
    if resume is not None:  # a checkpoint loads only under the backend that wrote it (any process count)
        elastic.check_backend(resume, dims.strategy, dims.processes)
    for folder in data.folders:
        note = check_tokenizer(folder, tokenizer)
        if note and args.process_index == 0:
            print(f"hftrain: {note}", flush=True)
    if data.section.preference_data:  # before the model loads: pairs DPO cannot learn from
        source = data.section.train[0]
        said = same_answers(first_pairs(data, SAME_ANSWERS_SAMPLE), tokenizer, f"data.train ({source.path or source.dataset})")
        if said and args.process_index == 0:
            print(f"hftrain: warning: {said}", flush=True)
    return checkpoints, tokenizer, is_new, resume


def build_model_for(part: ModelBuildPart, settings: TrainingSettings, tokenizer: Any, tokenizer_is_new: bool) -> tuple[Any, PackedCollator]:
    """The model as this run trains it (its loss, its fine-tuning method, its placement) and the batches' collator."""
    args, dims, section = settings.args, settings.dims, part.data.section
    model = build_model(part.model, tokenizer, tokenizer_is_new, dims)
    if part.fp8:
        fp8.apply(model, part.fp8)  # torchao's Float8Linear in the chosen layers (speed/fp8.py)
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
    if not part.objective.wraps_adapter:  # DPO: TRL wraps the adapter itself (training/dpo.py)
        model = apply_method(model, part.finetune, args.gradient_checkpointing)
    if dims.strategy is Strategy.DEVICE_MAP:
        model = parallel.spread_over_devices(model, part.max_memory)
    return model, collate


def announce(settings: TrainingSettings, resume: Path | None) -> None:
    """What the run decided before building anything: its length, its speed levers and where it resumes."""
    print(f"hftrain: {settings.length.note}", flush=True)
    if settings.speed.reasons:
        print(f"hftrain: speed defaults: {'; '.join(settings.speed.reasons)}", flush=True)
    if resume is not None:
        print(f"hftrain: resuming from {resume}")


@dataclass(frozen=True)
class TrainerInputs:
    """What the steps before build_trainer made for it."""

    model: Any
    tokenizer: Any
    tokenizer_is_new: bool
    collate: PackedCollator
    checkpoints: CheckpointManager
    metrics: StepMetrics
    guard: NonFiniteGuard
    resume: Path | None


def build_trainer(
    part: TrainerBuildPart, settings: TrainingSettings, built: TrainerInputs, callbacks: Sequence[Any] = ()
) -> HftrainTrainer:
    """The Trainer with hftrain's data, checkpoints, metrics, guard and callbacks, as the objective builds it
    (training/objectives.py: TRL's DPOTrainer behind them for finetune.objective dpo)."""
    args, metrics = settings.args, built.metrics
    options = TrainerOptions(
        dims=settings.dims, data=part.data, checkpoints=built.checkpoints, metrics=metrics, guard=built.guard, resume_from=built.resume
    )
    callbacks = [
        MetricsFileCallback(),
        *callbacks,
        InputCheckCallback(metrics.options),  # before step 1 on a GPU, before the clock starts: does the input keep up?
        ThroughputClockCallback(metrics),
        *([KeptCheckpointsCallback(part.kept)] if part.kept.keeps_any else []),  # none: no per-step lookup at all
    ]
    parts = TrainerParts(part.trainer, options, built.model, args, built.tokenizer, built.collate, callbacks, built.tokenizer_is_new)
    trainer = objectives.build_trainer(part.objective.name, parts)  # its own Trainer per objective
    if part.profile.start_step is not None:
        trainer.add_callback(ProfilerCallback(part.profile, built.checkpoints.layout.root, args.process_index))
    return trainer


def metrics_options(part: TrainerBuildPart, settings: TrainingSettings) -> MetricsOptions:
    """The fixed numbers of the step metrics; the MFU peak is the recipe's, else measured here now."""
    args, monitor = settings.args, part.monitor
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = monitor.peak_tflops * 1e12 if monitor.peak_tflops else measure_peak_flops(args.device, peak_dtype)
    return MetricsOptions(
        tokens_per_step=settings.dims.global_batch * part.data.section.seq_len,
        world_size=args.world_size,
        flops_per_token=part.flops_per_token,
        peak_flops=peak,
        price_per_hour=monitor.price_per_hour,
        input_bound_threshold=monitor.input_bound_threshold,
        dataloader_workers=args.dataloader_num_workers,
    )


def outside_services(part: ServicesPart, trainer: HftrainTrainer) -> tuple[CheckpointPusher, trackers.Trackers]:
    """What shares the run's checkpoints and what reports its metrics, both through the run's outbox: a service
    that is down never stops or slows training (outbox.py, trackers.py)."""
    args = trainer.args
    outbox = Outbox(Path(args.output_dir), owner=args.should_save)
    reporters = trackers.Trackers(trainer, outbox, part.network_timeout_s)
    publish, push = part.publish, part.push_to_hub
    pusher = CheckpointPusher(publish, args, push, outbox, revisions.publisher(publish, args, push, outbox))
    return pusher, reporters


def fit(trainer: HftrainTrainer, resume: Path | None, flags: StepFlags, dims: ParallelDims, checkpoints: CheckpointManager) -> None:
    """Train to max_steps; a SIGTERM / SIGUSR1 saves a checkpoint at the next step and stops (Preempted)."""
    preemption = PreemptionCallback(flags)  # its agreement rides on the guard's one per step
    trainer.add_callback(preemption)
    latest = checkpoints.latest
    where = lambda: f"the last complete checkpoint is {latest()}" if latest() else "no checkpoint is complete yet"  # noqa: E731
    heartbeat = liveness.Heartbeat(dims, where, step=lambda: trainer.state.global_step)  # a lost or stuck node is named
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
        saved = checkpoints.layout.checkpoint(preemption.step)
        raise Preempted(
            f"stopped by {preemption.received} after step {preemption.step}; saved {saved}. "
            "Run the same command again to continue from there."
        )


@dataclass(frozen=True)
class Finishing:
    """What the finish step reads: its part, what the run became, the checkpoints, and what results.json records."""

    part: FinishPart
    as_run: AsRun
    checkpoints: CheckpointManager
    known: dict[str, Any]  # from the run's start: parameters, speed choices with their measurements, run length
    facts: Callable[[], dict[str, Any]]  # how the run ran (run_facts), read when the results are written


def already_finished(trainer: HftrainTrainer, done: Finishing, resume: Path) -> Run:
    """The checkpoint is at max_steps: nothing to train (the Trainer would still take one more step)."""
    from transformers.trainer_callback import TrainerState

    print(f"hftrain: {resume} is already at training.max_steps={trainer.args.max_steps}; nothing to train (raise max_steps to continue).")
    trainer.state = TrainerState.load_from_json(str(resume / TRAINER_STATE_FILE))
    layout = done.checkpoints.layout
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # sharded weights load only inside train()
        metrics = read_json(layout.results, "the run's results") if layout.results.is_file() else {}
        return Run(done.as_run, layout.root, layout.final, trainer, metrics=metrics)
    done.checkpoints.load_weights(trainer.model, resume)
    return finish(trainer, done)


def finish(trainer: HftrainTrainer, done: Finishing) -> Run:
    """Save the final model, evaluate it, write the results, plot and summary."""
    checkpoints, monitor = done.checkpoints, done.part.monitor
    layout = checkpoints.layout
    staged = checkpoints.stage_final(trainer)
    metrics = trainer.evaluate()
    run = Run(done.as_run, layout.root, layout.final, trainer, metrics=metrics)
    if not trainer.args.should_save:
        return run
    checkpoints.publish_final(staged, {"step": trainer.state.global_step, "eval_loss": metrics["eval_loss"]})
    results = build_results(trainer.state.global_step, metrics, run.log_history, {**done.facts(), **done.known})
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


def run_facts(trainer: HftrainTrainer, metrics: StepMetrics, dims: ParallelDims, data: DataPlan) -> Callable[[], dict[str, Any]]:
    """What results.json records about how the run ran, beyond its metrics: read when the results are written."""

    def facts() -> dict[str, Any]:
        loader = trainer.train_loader
        skipped = 0 if loader is None else sum(int(p.get("start", {}).get("docs", {}).get("skipped", 0)) for p in loader.positions.values())
        return {
            **metrics.run_split(),
            "bf16": trainer.args.bf16,
            "torch_compile": trainer.args.torch_compile,
            **trainer.distribution,
            "data_records_skipped": skipped,
            "data_readers": dims.readers.readers,
            "shuffle_window": dims.readers.window,
            "packing_fill": None if loader is None or loader.fill is None else round(loader.fill, 4),
            "document_masking": data.section.masks_documents,
        }

    return facts


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
