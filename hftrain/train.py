"""One training run, start to finish: recipe -> tokenizer -> model -> data -> Trainer -> final checkpoint.

`train()` is the single code path behind `hftrain train`, `accelerate launch -m hftrain train` and the
Python API. It resumes an interrupted run in the same output_dir on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import TrainingArguments

from . import checkpoint as ckpt
from . import cpu_compat, parallel, speed
from .eval_metrics import TrainingEvaluation
from .finetune import apply_method
from .hub import CheckpointPusher
from .callbacks import MetricsFileCallback, PreemptionCallback, ThroughputClockCallback
from .data.pretokenized import check_compatible
from .data.loader import PackedDataset, collate_blocks, first_documents, plan_data, validation_blocks
from .errors import HftrainError, Preempted
from .model import build_model, meta_model, parameter_counts
from .plan import flops_per_token, measure_peak_flops, tokenizer_size_estimate
from .plot import PLOT_FILE, plot_curves
from .profiling import ProfilerCallback
from .recipe_schema import Recipe
from .step_timing import PHASES, input_bound_advice, peak_memory_gb
from .tokenizer import load_tokenizer
from .trainer import HftrainTrainer

RESULTS_FILE = "results.json"
EVAL_TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


@dataclass
class Run:
    """What a finished run leaves behind, for the CLI summary and for notebooks."""

    recipe: Recipe
    output_dir: Path
    final_dir: Path
    trainer: HftrainTrainer
    metrics: dict[str, float] = field(default_factory=dict)
    sample: str = ""
    plot_path: Path | None = None

    _loaded: Any = None

    @property
    def log_history(self) -> list[dict[str, Any]]:
        return self.trainer.state.log_history

    @property
    def model(self) -> Any:
        """The trained model; read back from final_dir when training sharded it over processes."""
        if not (self.trainer.is_fsdp_enabled or self.trainer.is_deepspeed_enabled):
            return self.trainer.model
        if self._loaded is None:
            from transformers import AutoModelForCausalLM
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()  # else from_pretrained would partition the copy with ZeRO-3 collectives
            self._loaded = AutoModelForCausalLM.from_pretrained(self.final_dir)
        return self._loaded

    def plot(self) -> Any:
        """The loss / grad-norm curves: shown inline in a notebook, else the PNG's path."""
        path = self.plot_path or plot_curves(self.log_history, self.output_dir / PLOT_FILE, title=str(self.output_dir))
        try:
            from IPython.display import Image

            return Image(filename=str(path))
        except ImportError:
            return path

    @property
    def last_loss(self) -> float | None:
        losses = [e["loss"] for e in self.log_history if "loss" in e]
        return losses[-1] if losses else None

    def push(self, repo_id: str | None = None, *, to: str | None = None, private: bool | None = None, revision: str | None = None) -> str:
        """Share the final model: to the hub (repo_id) or to an s3:// / fsspec URL (to)."""
        from .hub import push_run

        return push_run(self.output_dir, repo_id=repo_id, to=to, private=private, revision=revision)

    def generate(self, prompt: str, max_new_tokens: int = 48, seed: int = 0) -> str:
        """Sample a continuation of `prompt` from the trained model (top-k 40, temperature 0.8)."""
        tok, model = self.trainer.processing_class, self.model
        inputs = tok(prompt, return_tensors="pt").to(model.device)
        torch.manual_seed(seed)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8, pad_token_id=tok.eos_token_id
            )
        model.train(was_training)
        return tok.decode(out[0], skip_special_tokens=True)


def training_arguments(recipe: Recipe, strategy: str) -> tuple[TrainingArguments, bool | str | None, bool, list[str]]:
    """TrainingArguments from the recipe's training section, the resume setting, push_to_hub (both handled
    by hftrain: the Trainer's own push would upload output_dir's root, see hub.py) and the speed defaults chosen."""
    kwargs = parallel.batch_kwargs(recipe, recipe.training_kwargs(), parallel.world_size())
    resume = kwargs.pop("resume_from_checkpoint", None)
    push = bool(kwargs.pop("push_to_hub", False))
    if not kwargs.get("max_steps") or kwargs["max_steps"] <= 0:
        raise HftrainError(
            "training.max_steps: required. hftrain streams its data, so a run is measured in optimizer steps, "
            "not epochs; set e.g. training.max_steps=1000."
        )
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    # hftrain restores the data position itself (replaying batches would re-read the consumed data),
    # and its batches hold only model inputs.
    kwargs.update(ignore_data_skip=True, remove_unused_columns=False)
    kwargs = cpu_compat.training_kwargs(kwargs)
    decisions = speed_defaults(recipe, kwargs, strategy)
    try:
        return TrainingArguments(**kwargs), resume, push, decisions
    except (ValueError, TypeError) as err:
        raise HftrainError(f"training: {err}") from None


def speed_defaults(recipe: Recipe, kwargs: dict[str, Any], strategy: str) -> list[str]:
    """bf16 / torch_compile where the recipe leaves them unset (speed.py), from the model's size on the meta device."""
    device = torch.device("cpu" if kwargs.get("use_cpu") or not torch.cuda.is_available() else "cuda")
    if all(key in kwargs for key in ("bf16", "torch_compile")):  # nothing depends on the model's size
        return speed.apply_defaults(recipe, kwargs, strategy, {}, 0.0, device)
    try:
        size, is_new = tokenizer_size_estimate(recipe)
        model = meta_model(recipe, size, is_new)
    except (OSError, ValueError, KeyError, HftrainError):  # a bad model/tokenizer gets its own message when loaded
        return speed.apply_defaults(recipe, kwargs, strategy, {"matmul_params": 0, "hidden_size": 0}, 0.0, device)
    tokens = kwargs["per_device_train_batch_size"] * kwargs.get("gradient_accumulation_steps", 1) * recipe.data.seq_len
    counts = parameter_counts(model)
    per_step = tokens * flops_per_token(counts, model.config, recipe.data.seq_len)
    shape = {"matmul_params": counts["total"] - counts["embedding"], "hidden_size": model.config.hidden_size}
    return speed.apply_defaults(recipe, kwargs, strategy, shape, per_step, device)


def resume_point(setting: bool | str | None, output_dir: Path) -> Path | None:
    """training.resume_from_checkpoint: unset/true = latest complete checkpoint, false = never, or a path."""
    if setting is False or (isinstance(setting, str) and setting.lower() == "false"):
        return None
    if isinstance(setting, str) and setting.lower() != "true":
        path = Path(setting)
        if not (path / ckpt.COMPLETE_MARKER).is_file():
            raise HftrainError(f"training.resume_from_checkpoint: {setting} is not a complete hftrain checkpoint.")
        return path
    latest = ckpt.latest_checkpoint(output_dir)
    if latest is None and setting in (True, "true", "True"):
        raise HftrainError(f"training.resume_from_checkpoint: true, but {output_dir} holds no complete checkpoint.")
    return latest


def train(recipe: Recipe, callbacks: Sequence[Any] = ()) -> Run:
    """Run the recipe; `callbacks` are extra transformers TrainerCallbacks (Python API, benchmarks)."""
    strategy = parallel.resolve_strategy(recipe)
    args, resume_setting, push, speed_choices = training_arguments(recipe, strategy)
    output_dir = Path(args.output_dir)
    is_main = args.process_index == 0
    data_plan = plan_data(recipe.data, args.seed)
    # The main process prepares the shared output directory (and trains a tokenizer) before the others read it.
    with args.main_process_first(desc="preparing the output directory"):
        ckpt.claim_output_dir(output_dir, recipe, is_main)
        if is_main:
            for leftover in ckpt.clean_partial(output_dir):
                print(f"hftrain: removed {leftover} (an interrupted save)")
        tokenizer, tokenizer_is_new = load_tokenizer(recipe, output_dir, lambda n: first_documents(data_plan, n))
    resume = resume_point(resume_setting, output_dir)
    if speed_choices and is_main:
        print(f"hftrain: speed defaults: {'; '.join(speed_choices)}", flush=True)
    if resume is not None and is_main:
        print(f"hftrain: resuming from {resume}")
    if data_plan.pretokenized is not None:
        check_compatible(data_plan.manifest, data_plan.pretokenized.pretokenized, recipe.data.seq_len, tokenizer)
    model = build_model(recipe, tokenizer, tokenizer_is_new)
    model = apply_method(model, recipe, args.gradient_checkpointing)
    if strategy == "device_map":
        model = parallel.spread_over_devices(model, recipe)
    eval_set = validation_blocks(data_plan, tokenizer)

    counts = parameter_counts(model)
    per_token = flops_per_token(counts, model.config, recipe.data.seq_len)
    peak_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    peak = recipe.monitor.peak_tflops * 1e12 if recipe.monitor.peak_tflops else measure_peak_flops(args.device, peak_dtype)

    trainer = HftrainTrainer(
        model=model,
        args=args,
        train_dataset=PackedDataset(data_plan, tokenizer, args.process_index, args.world_size, None),
        eval_dataset=eval_set,
        processing_class=tokenizer,
        data_collator=collate_blocks,
        callbacks=[MetricsFileCallback(), *callbacks],
        recipe=recipe,
        data_plan=data_plan,
        flops_per_token=per_token,
        peak_flops=peak,
        strategy=strategy,
        pusher=CheckpointPusher(recipe, args, push),
    )
    trainer.evaluation = TrainingEvaluation(eval_set, tokenizer, recipe.monitor.eval_tasks)
    trainer.add_callback(ThroughputClockCallback(trainer))
    if recipe.profile.start_step is not None:
        trainer.add_callback(ProfilerCallback(recipe.profile, output_dir, args.process_index))
    preemption = PreemptionCallback()
    trainer.add_callback(preemption)
    trainer.set_resume_dir(resume)
    if resume is not None and _step_of(resume) >= args.max_steps:
        # The Trainer would still take one more step; there is nothing left to train.
        print(f"hftrain: {resume} is already at training.max_steps={args.max_steps}; nothing to train (raise max_steps to continue).")
        preemption.restore()
        from transformers.trainer_callback import TrainerState

        trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
        if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # sharded weights load only inside train()
            results = output_dir / RESULTS_FILE
            metrics = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else {}
            return Run(recipe, output_dir, output_dir / ckpt.FINAL, trainer, metrics=metrics)
        trainer._load_from_checkpoint(str(resume))
        return finish(trainer, recipe, output_dir, counts)
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        preemption.restore()
    if preemption.step is not None:
        raise Preempted(
            f"stopped by {preemption.received} after step {preemption.step}; saved {output_dir / f'checkpoint-{preemption.step}'}. "
            "Run the same command again to continue from there."
        )
    return finish(trainer, recipe, output_dir, counts)


def _step_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))["global_step"])


def finish(trainer: HftrainTrainer, recipe: Recipe, output_dir: Path, counts: dict[str, int]) -> Run:
    """Save the final model, evaluate it, write the plot and results, and print the summary."""
    final_dir = output_dir / ckpt.FINAL
    staged = output_dir / ckpt.STAGING / ckpt.FINAL
    ckpt.save_full_model(trainer, staged)
    run = Run(recipe, output_dir, final_dir, trainer)
    metrics = trainer.evaluate()
    run.metrics = metrics
    if not trainer.args.should_save:
        return run
    ckpt.write_extras(staged, recipe)
    (staged / "training_args.bin").unlink(missing_ok=True)  # a pickle: not part of a shareable model
    ckpt.publish(staged, final_dir, {"step": trainer.state.global_step, "eval_loss": metrics["eval_loss"]})
    rates = [e["tokens_per_s"] for e in run.log_history if "tokens_per_s" in e]
    mfus = [e["mfu"] for e in run.log_history if "mfu" in e]
    results = {
        "step": trainer.state.global_step,
        "eval_loss": metrics["eval_loss"],
        **{k: v for k, v in metrics.items() if k.startswith("eval_") and k not in EVAL_TIMINGS},
        "tokens_per_s_median": _median(rates),
        "mfu_median": _median(mfus),
        **time_split(trainer),
        "bf16": trainer.args.bf16,
        "torch_compile": trainer.args.torch_compile,
        "parameters": counts,
        **trainer.distribution,
        "data_records_skipped": _skipped(trainer),
    }
    if recipe.monitor.sample_max_new_tokens:
        run.sample = run.generate(recipe.monitor.sample_prompt, recipe.monitor.sample_max_new_tokens)
        results["sample"] = run.sample
    if recipe.monitor.plot:
        run.plot_path = plot_curves(run.log_history, output_dir / PLOT_FILE, title=str(output_dir))
    (output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2), encoding="utf-8")
    _print_summary(run, results)
    if trainer.pusher.enabled:
        try:
            for target in trainer.pusher.on_end(output_dir, final_dir):
                print(f"pushed: {target}", flush=True)
        except HftrainError as err:
            raise HftrainError(
                f"training finished and is saved in {final_dir}, but sharing it failed: {err}. "
                f"Push it later with `hftrain push {output_dir} --repo-id {trainer.pusher.repo_id()}`."
            ) from None
    return run


def time_split(trainer: HftrainTrainer) -> dict[str, Any]:
    """The run-wide share of step time per phase, peak memory and the input-bound verdict."""
    timer, threshold = trainer.timer, trainer.recipe.monitor.input_bound_threshold
    out: dict[str, Any] = {f"{name}_frac": round(f, 4) for name in PHASES if (f := timer.run_fraction(name)) is not None}
    out["peak_mem_gb"] = round(peak_memory_gb(trainer.args.device), 3)
    wait = out.get("data_wait_frac")
    out["input_bound"] = wait is not None and wait > threshold and timer.intervals >= 2  # as the live warning
    return out


def _skipped(trainer: HftrainTrainer) -> int:
    loader = trainer.train_loader
    if loader is None:
        return 0
    return sum(int(p.get("start", {}).get("docs", {}).get("skipped", 0)) for p in loader.positions.values())


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _print_summary(run: Run, results: dict[str, Any]) -> None:
    lines = [
        "",
        f"final checkpoint: {run.final_dir}",
        f"validation loss {results['eval_loss']:.4f}, perplexity {results['eval_perplexity']:.2f}, "
        f"bits per byte {results.get('eval_bits_per_byte', float('nan')):.3f}",
    ]
    extra = [f"{k.removeprefix('eval_')} {v:.4g}" for k, v in results.items()
             if k.startswith("eval_") and k not in ("eval_loss", "eval_perplexity", "eval_bits_per_byte")]
    if extra:
        lines.append("evaluation: " + ", ".join(extra))
    if results["tokens_per_s_median"]:
        lines.append(f"throughput: {results['tokens_per_s_median']:,.0f} tokens/s (median), MFU {100 * (results['mfu_median'] or 0):.2f}%")
    if results.get("data_wait_frac") is not None:
        if results["input_bound"]:
            lines.append(input_bound_advice(results["data_wait_frac"], run.recipe.monitor.input_bound_threshold,
                                            run.trainer.args.dataloader_num_workers))
        else:
            split = ", ".join(f"{name.replace('_', ' ')} {100 * results[f'{name}_frac']:.0f}%" for name in PHASES if f"{name}_frac" in results)
            lines.append(f"step time: {split}; peak memory {results['peak_mem_gb']:.2f} GB")
    if run.plot_path:
        lines.append(f"plot: {run.plot_path}")
    if run.sample:
        lines.append(f"sample: {run.sample!r}")
    print("\n".join(lines), flush=True)
