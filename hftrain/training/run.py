"""One training run, start to finish, on one page:

    resolve (training/resolve.py: reads, changes nothing) -> set up (every side effect: network bound, process
    set-up, the TrainingArguments made once with the speed probe's levers) -> prepare the output directory ->
    build (the model: model/part.py, then the Trainer with its callbacks: training/trainer_build.py) -> fit
    (train, resuming where a checkpoint is) -> finish (final model, results, summary) -> share

`train()` is the single code path behind `hftrain train`, `accelerate launch -m hftrain train` and the Python
API. It resumes an interrupted run in the same output_dir on its own. `run` hands each component its part of the
resolved RunSpec and the runtime objects the builds before it made, and each part builds its component
(`spec.model.build(...)`, `spec.trainer.build(...)`: the part is defined beside it); no step sees the recipe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain import _compat, network, progress
from hftrain.checkpoint import elastic
from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.integrity import step_of, unreadable
from hftrain.checkpoint.layout import TRAINER_STATE_FILE, RunLayout
from hftrain.checkpoint.manager import CheckpointManager
from hftrain.checkpoint.node_disks import common_resume
from hftrain.checkpoint.output_lock import owning
from hftrain.data.loader import DataPlan, first_documents, first_pairs
from hftrain.data.megatron import MegatronCorpus
from hftrain.data.preference_pairs import SAME_ANSWERS_SAMPLE, same_answers
from hftrain.data.token_folder import check_tokenizer
from hftrain.errors import Preempted
from hftrain.integrations.hub import CheckpointPusher
from hftrain.integrations.outbox import Failure, Outbox
from hftrain.model.generation import end_of_run_sample
from hftrain.model.part import ModelPart
from hftrain.model.tokenizer import load_tokenizer
from hftrain.parallel import dims as parallel
from hftrain.parallel import liveness
from hftrain.parallel.dims import LaunchEnv, ParallelDims
from hftrain.planning.run_length import RunLength
from hftrain.recipe.sections import MonitorSection
from hftrain.speed.defaults import SpeedPlan
from hftrain.training.arguments import set_up, start_record
from hftrain.training.plot import plot_curves
from hftrain.training.resolve import RunSpec, recorded_start, resolve
from hftrain.training.results import build_results, summary
from hftrain.training.run_record import AsRun, Run
from hftrain.training.trainer import HftrainTrainer

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> Run:
    """Run the recipe; `callbacks` are extra transformers TrainerCallbacks (Python API, benchmarks). The run owns
    its output_dir while it trains: a second, independent launch into it is refused (checkpoint/output_lock.py)."""
    progress.start()  # a line at least every few seconds until the first step ends (StepMetrics.step_done)
    try:
        _compat.quiet_optional_warnings()  # before resolving imports the libraries (a logger level and an import check)
        _compat.skip_unneeded_imports()
        # reads only; refuses before output_dir is touched
        spec = resolve(recipe, LaunchEnv.read(), recorded_start(recipe))
        with owning(str(spec.checkpoints.output_dir), "training.output_dir"):
            return run(spec, callbacks)
    finally:
        progress.stop()


def run(spec: RunSpec, callbacks: Sequence[Any]) -> Run:
    """A resolved run: set up -> build -> fit -> finish -> share, each component from its part of the spec and the
    objects the builds before it made."""
    if spec.fit_note and spec.launch.rank == 0:  # said at once: before the speed probe measures anything
        print(f"hftrain: {spec.fit_note}", flush=True)
    network.configure(spec.network_timeout_s)  # every network client from here on answers within this bound
    parallel.prepare_process(spec.dims)  # a CPU rehearsal's backend, DeepSpeed's config path
    dims = spec.dims
    output_dir = spec.checkpoints.output_dir
    args, speed = set_up(spec.arguments, dims, spec.shape, spec.speed, spec.model, spec.recorded, output_dir)
    checkpoints = spec.checkpoints.build(dims)
    tokenizer, tokenizer_is_new, resume = prepare_output(checkpoints, spec.model, spec.data, args, dims)
    if args.process_index == 0:
        announce(spec.length, speed, resume)
    model = spec.model.build(
        tokenizer,
        tokenizer_is_new,
        dims,
        fp8=speed.fp8,
        chunked_loss=speed.chunked_loss,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    outbox = Outbox(Path(args.output_dir), owner=args.should_save)  # the outside services' journal
    trainer, reporters = spec.trainer.build(
        args, dims, model, tokenizer, tokenizer_is_new, checkpoints, resume, outbox, callbacks
    )
    pusher = spec.publish.build(args, outbox)
    pusher.recover()  # what a killed launch of this run queued and did not send
    checkpoints.on_publish.append(pusher.on_checkpoint)
    if resume is None and spec.trainer.kept.keeps(0):  # Pythia's step0: the weights before the first step
        initial = checkpoints.save_initial(trainer)
        if initial is not None:
            pusher.on_initial(initial)
    known = {"parameters": spec.shape.counts, "speed": speed.to_json(), "run_length": spec.length.to_json()}
    monitor, as_run = spec.trainer.monitor, spec.as_run
    with reporters.session(args):  # the trackers' last reports are sent (or kept as failures) before sharing
        if resume is not None and step_of(resume) >= args.max_steps:
            result = already_finished(trainer, monitor, as_run, known, resume)
        else:
            if resume is not None:
                elastic.prepare_resume(trainer, resume)  # ZeRO-3 on another process count: universal checkpoint
            fit(trainer, resume)
            result = finish(trainer, monitor, as_run, known)
    if args.should_save and checkpoints.layout.final.is_dir():  # the process that saves, once the final model is there
        result.not_shared = share(pusher, checkpoints.layout)
    return result


def prepare_output(
    checkpoints: CheckpointManager, model: ModelPart, data: DataPlan, args: Any, dims: ParallelDims
) -> tuple[Any, bool, Path | None]:
    """The output directory claimed, the tokenizer, and where the run resumes. The main process prepares the shared
    directory (and trains a tokenizer) before the others read it."""
    with args.main_process_first(desc="preparing the output directory"):
        # should_save: each node's first process on node-local disks
        checkpoints.claim(args.should_save, start_record(args, dims))
        tokenizer, is_new = load_tokenizer(model, checkpoints.layout.root, lambda n: first_documents(data, n))
        resume = common_resume(checkpoints.resume_point(args.should_save), checkpoints.complete(), dims, unreadable)
    if resume is not None:  # a checkpoint loads only under the backend that wrote it (any process count)
        elastic.check_backend(resume, dims.strategy, dims.processes)
    for folder in data.folders:
        if isinstance(folder, MegatronCorpus):  # its files name no tokenizer: every id read is checked against it
            continue
        note = check_tokenizer(folder, tokenizer)
        if note and args.process_index == 0:
            print(f"hftrain: {note}", flush=True)
    if data.section.preference_data:  # before the model loads: pairs DPO cannot learn from
        source = data.section.train[0]
        said = same_answers(
            first_pairs(data, SAME_ANSWERS_SAMPLE), tokenizer, f"data.train ({source.path or source.dataset})"
        )
        if said and args.process_index == 0:
            print(f"hftrain: warning: {said}", flush=True)
    return tokenizer, is_new, resume


def announce(length: RunLength, speed: SpeedPlan, resume: Path | None) -> None:
    """What the run decided before building anything: its length, its speed levers and where it resumes."""
    print(f"hftrain: {length.note}", flush=True)
    if speed.reasons:
        print(f"hftrain: speed defaults: {'; '.join(speed.reasons)}", flush=True)
    if resume is not None:
        print(f"hftrain: resuming from {resume}")


def fit(trainer: HftrainTrainer, resume: Path | None) -> None:
    """Train to max_steps; a SIGTERM / SIGUSR1 saves a checkpoint at the next step and stops (Preempted)."""
    options = trainer.options
    preemption, checkpoints = options.preemption, options.checkpoints
    latest = checkpoints.latest

    def where() -> str:
        return f"the last complete checkpoint is {latest()}" if latest() else "no checkpoint is complete yet"

    # a lost or stuck node is named
    heartbeat = liveness.Heartbeat(options.dims, where, step=lambda: trainer.state.global_step)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except Exception as failure:
        lost = liveness.lost_peers(options.dims, failure, where())
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


def already_finished(
    trainer: HftrainTrainer, monitor: MonitorSection, as_run: AsRun, known: dict[str, Any], resume: Path
) -> Run:
    """The checkpoint is at max_steps: nothing to train (the Trainer would still take one more step)."""
    from transformers.trainer_callback import TrainerState

    print(
        f"hftrain: {resume} is already at training.max_steps={trainer.args.max_steps}; nothing to train (raise "
        "max_steps to continue)."
    )
    trainer.state = TrainerState.load_from_json(str(resume / TRAINER_STATE_FILE))
    checkpoints = trainer.options.checkpoints
    layout = checkpoints.layout
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # sharded weights load only inside train()
        metrics = read_json(layout.results, "the run's results") if layout.results.is_file() else {}
        return Run(as_run, layout.root, layout.final, trainer, metrics=metrics)
    checkpoints.load_weights(trainer.model, resume)
    return finish(trainer, monitor, as_run, known)


def finish(trainer: HftrainTrainer, monitor: MonitorSection, as_run: AsRun, known: dict[str, Any]) -> Run:
    """Save the final model, evaluate it, write the results (`known`: what the run's start decided: parameters,
    speed choices with their measurements, run length), plot and summary."""
    checkpoints = trainer.options.checkpoints
    layout = checkpoints.layout
    staged = checkpoints.stage_final(trainer)
    metrics = trainer.evaluate()
    run = Run(as_run, layout.root, layout.final, trainer, metrics=metrics)
    if not trainer.args.should_save:
        return run
    checkpoints.publish_final(staged, {"step": trainer.state.global_step, "eval_loss": metrics["eval_loss"]})
    results = build_results(trainer.state.global_step, metrics, run.log_history, {**run_facts(trainer), **known})
    if monitor.sample_max_new_tokens:
        run.sample = results["sample"] = end_of_run_sample(run.model, trainer.processing_class, monitor)
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
    loader, options = trainer.train_loader, trainer.options
    skipped = (
        0
        if loader is None
        else sum(int(p.get("start", {}).get("docs", {}).get("skipped", 0)) for p in loader.positions.values())
    )
    return {
        **options.metrics.run_split(),
        "bf16": trainer.args.bf16,
        "torch_compile": trainer.args.torch_compile,
        **trainer.distribution,
        "data_records_skipped": skipped,
        "data_readers": options.dims.readers.readers,
        "shuffle_window": options.dims.readers.window,
        "packing_fill": None if loader is None or loader.fill is None else round(loader.fill, 4),
        "document_masking": options.data.section.masks_documents,
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
        layout.results.write_text(
            json.dumps({**results, "not_shared": [f.to_json() for f in failures]}, indent=2), encoding="utf-8"
        )
    pusher.outbox.settle()  # what was owed is sent or written down: the journal goes
    return failures
