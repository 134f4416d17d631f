"""The Hugging Face Trainer, changed only where hftrain must:

* the training data comes from hftrain's resumable packed stream (each rank reads its own part), and its
  position is saved in every checkpoint instead of replaying batches on resume (``ignore_data_skip``);
* checkpoints are staged and renamed into place when complete (see checkpoint.py);
* resuming loads weights through transformers' key mapping, strictly (the GPT-NeoX head trap);
* every training log line gets tokens seen, tokens/s (total and per device), MFU, tokens per dollar, the
  share of step time spent waiting for data (and on CPU forward/backward/optimizer), and peak memory
  (see step_timing.py); a run that mostly waits for data is told so.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from . import checkpoint as ckpt
from . import cpu_compat, parallel
from .data.loader import DataPlan, PackedDataset, ResumableLoader, check_resumable
from .errors import HftrainError
from .eval_metrics import TrainingEvaluation
from .finetune import BASE_FILE, base_fingerprint, is_adapter_dir
from .recipe_schema import Recipe
from .step_timing import EXCLUDED, StepTimer, input_bound_advice, peak_memory_gb


class HftrainTrainer(Trainer):
    def __init__(
        self, *args: Any, recipe: Recipe, data_plan: DataPlan, flops_per_token: float, peak_flops: float, strategy: str,
        pusher: Any, **kwargs: Any,
    ):  # fmt: skip
        self.strategy, self.pusher = strategy, pusher
        super().__init__(*args, **kwargs)
        self.recipe, self.data_plan = recipe, data_plan
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.train_loader: ResumableLoader | None = None
        self.skipped_steps: list[int] = []
        self._nonfinite = False
        self._resume_dir: Path | None = None
        self._last_logged_step: int | None = None
        self.timer = StepTimer(split=self.args.device.type == "cpu")
        self._warned_input_bound = False
        self.evaluation: TrainingEvaluation | None = None  # extra eval metrics (eval_metrics.py), set by train()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        cpu_compat.after_accelerator(self)
        self.distribution = parallel.verify(self, self.strategy)

    # ------------------------------------------------------------------------------------ data
    def set_resume_dir(self, checkpoint: Path | None) -> None:
        self._resume_dir = checkpoint

    def get_train_dataloader(self) -> ResumableLoader:
        args = self.args
        resume = None
        if self._resume_dir is not None:
            state_file = self._resume_dir / ckpt.data_state_file(args.process_index)
            if not state_file.is_file():
                raise_missing_position(state_file)
            resume = json.loads(state_file.read_text(encoding="utf-8"))
            check_resumable(resume, args.dataloader_num_workers, args.world_size, str(state_file))
        dataset = PackedDataset(self.data_plan, self.processing_class, args.process_index, args.world_size, resume)
        self.train_loader = ResumableLoader(
            dataset, args.per_device_train_batch_size, args.dataloader_num_workers, args.dataloader_prefetch_factor
        )
        return self.train_loader  # type: ignore[return-value]  # our own sharding: not accelerate-prepared

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer.phase("data_wait"):
            return super().get_batch_samples(*args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer.phase("forward"):
            return super().compute_loss(*args, **kwargs)

    # -------------------------------------------------------------------------- non-finite guard
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        with self.timer.phase("backward", label="training_step"):  # its forward is timed apart (compute_loss)
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss).all():
            self._nonfinite = True
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        with self.timer.phase("optimizer", label="clip_grad_norm"):
            return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        grad_norm = super()._get_grad_norm(model, grad_norm)
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            self._nonfinite = True
        if self._nonfinite:
            self._on_nonfinite(float(grad_norm) if grad_norm is not None else float("nan"))
        return grad_norm

    def _on_nonfinite(self, grad_norm: float) -> None:
        """Stop (keeping the last good checkpoint) or skip this optimizer step, as faults.on_nonfinite says."""
        step = self.state.global_step + 1
        policy = self.recipe.faults
        latest = ckpt.latest_checkpoint(Path(self.args.output_dir))
        kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was written yet"
        if policy.on_nonfinite == "stop" or len(self.skipped_steps) >= policy.max_skipped_steps:
            why = "faults.on_nonfinite=stop" if policy.on_nonfinite == "stop" else f"{len(self.skipped_steps)} steps already skipped (faults.max_skipped_steps)"
            raise HftrainError(
                f"training: non-finite loss or gradient norm ({grad_norm}) at step {step}; stopped ({why}). {kept}. "
                "Lower training.learning_rate, check the data, or set faults.on_nonfinite=skip."
            )
        self.skipped_steps.append(step)
        self._skip_optimizer_step = True
        print(f"hftrain: non-finite loss or gradient norm at step {step}: step skipped ({len(self.skipped_steps)} so far)", flush=True)

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model)
        self._skip_optimizer_step = False
        step = optimizer.step

        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self._skip_optimizer_step:  # parameters and optimizer state stay as they were
                self._skip_optimizer_step = self._nonfinite = False
                return None
            with self.timer.phase("optimizer"):
                return step(*args, **kwargs)

        optimizer.step = guarded_step
        return optimizer

    # ------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        with self.timer.phase(EXCLUDED, label="save_checkpoint"):  # not step time
            self._save_checkpoint_atomically(model, trial)

    def _save_checkpoint_atomically(self, model: Any, trial: Any) -> None:
        run_dir = Path(self.args.output_dir)
        staging_root = run_dir / ckpt.STAGING
        name = f"checkpoint-{self.state.global_step}"
        keep, self.args.save_total_limit = self.args.save_total_limit, None
        self.args.output_dir = str(staging_root)
        try:
            super()._save_checkpoint(model, trial)
        except OSError as err:  # disk full, unwritable, quota: the previous checkpoints are untouched
            shutil.rmtree(staging_root / name, ignore_errors=True)
            latest = ckpt.latest_checkpoint(run_dir)
            raise HftrainError(
                f"training.output_dir: could not write {run_dir / name} ({err.strerror or err}). "
                f"{'The previous checkpoint ' + str(latest) + ' is intact' if latest else 'No earlier checkpoint exists'}; "
                "free space or fix permissions, then run the same command to resume."
            ) from None
        finally:
            self.args.output_dir, self.args.save_total_limit = str(run_dir), keep
        staged = staging_root / name
        if self.train_loader is not None:
            position = json.dumps(self.train_loader.state_dict())
            (staged / ckpt.data_state_file(self.args.process_index)).write_text(position, encoding="utf-8")
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            ckpt.write_extras(staged, self.recipe)
            if is_adapter_dir(staged):  # an adapter checkpoint names its exact base
                base = self.recipe.model.from_pretrained or ""
                (staged / BASE_FILE).write_text(json.dumps(base_fingerprint(base), indent=2), encoding="utf-8")
            elif not (staged / "config.json").is_file():  # sharded saves: the checkpoint must still explain itself
                self.accelerator.unwrap_model(self.model).config.save_pretrained(staged)
                self.processing_class.save_pretrained(staged)
            ckpt.publish(staged, run_dir / name, {"step": self.state.global_step, "world_size": self.args.world_size})
            ckpt.rotate(run_dir, keep)
            self.pusher.on_checkpoint(run_dir / name)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or is_adapter_dir(Path(resume_from_checkpoint)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        ckpt.load_weights_exactly(model if model is not None else self.model, Path(resume_from_checkpoint))

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self.timer.phase(EXCLUDED, label="evaluate"):  # not step time
            return super().evaluate(*args, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        output = super().evaluation_loop(*args, **kwargs)
        if self.evaluation is not None and output.metrics is not None:
            prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
            model = self.accelerator.unwrap_model(self.model)
            output.metrics.update(self.evaluation.metrics(model, output.metrics.get(f"{prefix}_loss"), prefix))
        return output

    # ---------------------------------------------------------------------------------- metrics
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self._step_metrics())
        super().log(logs, start_time)

    def _step_metrics(self) -> dict[str, float]:
        """Throughput, MFU, cost, where the step time went and peak memory, since the previous log line."""
        args, step = self.args, self.state.global_step
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * self.data_plan.section.seq_len
        out: dict[str, float] = {"tokens_seen": float(step * per_step)}
        seconds, fractions = self.timer.take()
        if self._last_logged_step is not None and step > self._last_logged_step:
            rate = (step - self._last_logged_step) * per_step / seconds
            out["tokens_per_s"] = round(rate, 1)
            out["tokens_per_s_per_device"] = round(rate / args.world_size, 1)
            out["mfu"] = round(rate * self.flops_per_token / (self.peak_flops * args.world_size), 4)
            price = self.recipe.monitor.price_per_hour
            if price:
                out["tokens_per_usd"] = round(rate * 3600 / price, 1)
            out.update(fractions)
            self._warn_if_input_bound()
        out["peak_mem_gb"] = round(peak_memory_gb(args.device), 3)
        self._last_logged_step = step
        return out

    def _warn_if_input_bound(self) -> None:
        """Once, when the run so far (two log intervals at least: one slow read is no verdict) mostly waited."""
        threshold, fraction = self.recipe.monitor.input_bound_threshold, self.timer.run_fraction("data_wait")
        if self.timer.intervals < 2 or fraction is None or fraction <= threshold or self._warned_input_bound:
            return
        if self.is_world_process_zero():
            self._warned_input_bound = True
            print(f"hftrain: warning: {input_bound_advice(fraction, threshold, self.args.dataloader_num_workers)}", flush=True)

    def start_clock(self) -> None:
        self._last_logged_step = self.state.global_step
        self.timer.restart()


def raise_missing_position(state_file: Path) -> None:
    raise HftrainError(
        f"{state_file}: the checkpoint has no data position for this process. It was not written by hftrain "
        "(or with another process count); resume it with the same process count, or start a new training.output_dir."
    )
