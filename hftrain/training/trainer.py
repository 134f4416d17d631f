"""The Hugging Face Trainer, changed only where hftrain must:

* the training data comes from hftrain's resumable packed stream (each rank reads its own part), and its
  position is saved in every checkpoint instead of replaying batches on resume (``ignore_data_skip``);
* checkpoints go through the CheckpointManager (staged, then renamed into place when complete);
* resuming loads weights through transformers' key mapping, strictly (the GPT-NeoX head trap);
* each phase of a step is timed, and every training log line gets the step metrics (step_metrics.py);
* non-finite losses and gradient norms go to the guard (step_faults.py);
* evaluations add perplexity, bits per byte and the recipe's eval tasks (eval/during_training.py).

It receives one narrow ``TrainerOptions``, never the recipe, and its callbacks at construction
(training/trainer_build.py). What can be a callback is one, and attaches to any
Trainer (training/step_metrics.py, step_faults.py, speed/profiling.py); the public methods overridden here
(get_train_dataloader, compute_loss, training_step, evaluate, evaluation_loop, log, get_batch_samples,
create_accelerator_and_postprocess) are the Trainer's documented extension points. The private methods it
overrides are listed in ``PRIVATE_OVERRIDES`` with the reason no public hook serves and the upstream issue, and
sit together at the end; tests/test_structure.py checks that each exists, with the parameters relied on, in the
installed transformers (and the lowest-versions CI step at pyproject.toml's floor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from hftrain.checkpoint import elastic
from hftrain.checkpoint.adapter import is_adapter_dir
from hftrain.checkpoint.manager import CheckpointManager
from hftrain.data.loader import DataPlan, PackedDataset, Placement, ResumableLoader
from hftrain.data.step_batch import ConsumedRecord
from hftrain.eval.during_training import TrainingEvaluation
from hftrain.parallel import dims as parallel
from hftrain.parallel import rehearsal
from hftrain.parallel.dims import ParallelDims
from hftrain.parallel.readers import merge_positions
from hftrain.recipe.sections import LrScheduleSection
from hftrain.training.resumed_settings import ResumedSettings
from hftrain.training.schedules import gpt_neox_annealing
from hftrain.training.step_faults import NonFiniteGuard, PreemptionCallback
from hftrain.training.step_metrics import EXCLUDED, StepMetrics

PRIVATE_OVERRIDES = {  # name -> why no public hook serves (upstream issue)
    "_get_output_dir": "checkpoints are written into a staging directory and published whole; the Trainer writes "
    "checkpoint-N in place (transformers#27820 proposed a staged save upstream)",
    "_save_checkpoint": "the data position and the completion marker join each checkpoint; on_save runs after the "
    "files are written, too late to stage them (transformers#27820)",
    "_load_from_checkpoint": "weights load strictly through transformers' key mapping (the GPT-NeoX head trap); the "
    "Trainer's loader warns and continues on missing keys (no upstream issue filed)",
    "_load_rng_state": "on another process count the writer's rank-0 RNG state; the Trainer skips a file name it does "
    "not find (transformers#14554, #14994)",
    "_get_grad_norm": "hands the guard the norm the Trainer computed anyway; no callback receives it before the "
    "optimizer step (transformers#31033); on other Trainers the guard checks the gradients itself",
    "_clip_grad_norm": "the optimizer phase of the step timing starts at clipping; no callback runs between backward "
    "and clipping (transformers#31033)",
}


@dataclass(frozen=True)
class TrainerOptions:
    """What hftrain's Trainer needs beyond TrainingArguments (training/trainer_build.py makes it)."""

    dims: ParallelDims  # strategy, processes, batch and the run's logical readers (parallel/dims.py)
    data: DataPlan
    checkpoints: CheckpointManager
    metrics: StepMetrics
    guard: NonFiniteGuard  # also among the Trainer's callbacks: the Trainer feeds it the loss and gradient norm
    preemption: PreemptionCallback  # also among the callbacks: run.fit reads where it stopped
    nan_filter: bool = True  # training.logging_nan_inf_filter, done on the device (_finite_for_log)
    evaluation: TrainingEvaluation | None = None  # the objective's metrics on the held-out set (objectives.py)
    resume_from: Path | None = None
    resumed: ResumedSettings | None = None  # a resumed run: the recipe's optimizer settings over the checkpoint's
    lr_schedule: LrScheduleSection = field(default_factory=LrScheduleSection)  # type set: replaces transformers'
    schedule_first_step: int = 0  # the schedule's step at this run's first optimizer step (schedules.py)


class HftrainTrainer(Trainer):
    def __init__(self, *args: Any, options: TrainerOptions, **kwargs: Any):
        self.options = options  # before super().__init__: create_accelerator_and_postprocess reads the dims
        super().__init__(*args, **kwargs)
        self._finite_losses: torch.Tensor | None = None  # (sum, count) of the finite losses since the last log line
        self.timer = options.metrics.timer
        self.train_loader: ResumableLoader | None = None

    @property
    def skipped_steps(self) -> list[int]:
        return self.options.guard.skipped_steps

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        rehearsal.after_accelerator(self)
        self.distribution = parallel.verify(self, self.options.dims)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's schedule, or the recipe's lr_schedule (training/schedules.py) when its type is set: the
        Trainer keeps a schedule it finds set. A resumed run remembers the optimizer settings made from the recipe
        before the checkpoint's load over them (resumed_settings.py puts them back at train begin)."""
        options = self.options
        if options.lr_schedule.type is not None and self.lr_scheduler is None:
            over = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = gpt_neox_annealing(
                over, options.lr_schedule, num_training_steps, options.schedule_first_step
            )
        schedule = super().create_scheduler(num_training_steps, optimizer)
        if self.options.resumed is not None:
            self.options.resumed.remember(optimizer if optimizer is not None else self.optimizer)
        return schedule

    # ------------------------------------------------------------------------------------ data
    def get_train_dataloader(self) -> ResumableLoader:
        args, options, resume = self.args, self.options, None
        if options.resume_from is not None:
            saved = options.checkpoints.data_positions(options.resume_from)
            resume = merge_positions(
                saved, options.dims.readers, options.data.section.seq_len, str(options.resume_from)
            )
        dataset = PackedDataset(options.data, self.processing_class, args.process_index, options.dims.readers, resume)
        tokenizer = self.processing_class
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.train_loader = ResumableLoader(
            dataset,
            args.per_device_train_batch_size,
            args.dataloader_num_workers,
            args.dataloader_prefetch_factor,
            collate=self.data_collator,
            pad=pad,
            placement=Placement.of(args),  # pinned, copied without a wait on CUDA
            record=(
                ConsumedRecord(options.checkpoints.layout.batches, args.process_index, options.dims.processes)
                if options.data.section.record_batches
                else None
            ),
        )
        return self.train_loader  # type: ignore[return-value]  # our own sharding: not accelerate-prepared

    # ---------------------------------------------------------------------------- timed phases
    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer.phase("data_wait"):
            return super().get_batch_samples(*args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        with self.timer.phase("forward"):
            return super().compute_loss(*args, **kwargs)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        with self.timer.phase("backward", label="training_step"):  # its forward is timed apart (compute_loss)
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.options.guard.saw_loss(loss)
        return self._finite_for_log(loss) if self.options.nan_filter else loss

    def _finite_for_log(self, loss: torch.Tensor) -> torch.Tensor:
        """TrainingArguments.logging_nan_inf_filter without reading the loss on the host: a non-finite micro-batch
        loss is logged as the mean of the finite ones since the last log line (0 before any); the non-finite
        guard sees the real one."""
        finite = torch.isfinite(loss)
        if self._finite_losses is None:
            self._finite_losses = torch.zeros(2, device=loss.device, dtype=torch.float32)
        total, count = self._finite_losses[0], self._finite_losses[1]
        logged = torch.where(finite, loss, (total / count.clamp(min=1)).to(loss.dtype))
        self._finite_losses += torch.stack([torch.where(finite, loss.float(), 0.0), finite.float()])
        return logged

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with self.timer.phase(EXCLUDED, label="evaluate"):  # not step time
            return super().evaluate(*args, **kwargs)

    def evaluation_loop(self, *args: Any, metric_key_prefix: str = "eval", **kwargs: Any) -> Any:
        output = super().evaluation_loop(*args, metric_key_prefix=metric_key_prefix, **kwargs)
        if self.options.evaluation is not None and output.metrics is not None:
            model = self.accelerator.unwrap_model(self.model)
            loss = output.metrics.get(f"{metric_key_prefix}_loss")
            output.metrics.update(self.options.evaluation.metrics(model, loss, metric_key_prefix))
        return output

    # ---------------------------------------------------------------------------------- metrics
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.options.metrics.for_log_line(self.state.global_step, self.train_loader))
            seen = self._finite_losses
            if self.options.nan_filter and seen is not None and not bool(seen[1] > 0):  # read as the line's loss is
                logs["loss"] = float("nan")  # no finite micro-batch loss since the last line (skipped): not a 0.0
            self._finite_losses = None
        super().log(logs, start_time)

    # ----------------------------------------------- overrides of Trainer private methods (pinned)
    def _get_output_dir(self, trial: Any) -> str:
        """Checkpoints are written into the staging directory; the CheckpointManager publishes them."""
        return str(self.options.checkpoints.layout.staging)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        with self.timer.phase(EXCLUDED, label="save_checkpoint"):  # not step time
            position = self.train_loader.state_dict() if self.train_loader is not None else None
            write = lambda: super(HftrainTrainer, self)._save_checkpoint(model, trial)  # noqa: E731
            self.options.checkpoints.save(self, write, position)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or is_adapter_dir(Path(resume_from_checkpoint)):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self.options.checkpoints.load_weights(model if model is not None else self.model, Path(resume_from_checkpoint))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Another process count: the writer's rank-0 state for every process (elastic.py)."""
        if not elastic.load_rng_state(self, checkpoint):
            super()._load_rng_state(checkpoint)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self.options.guard.saw_grad_norm(grad_norm, self.state.global_step + 1)
        return grad_norm

    def _clip_grad_norm(self, model: Any) -> Any:
        with self.timer.phase("optimizer", label="clip_grad_norm"):
            return super()._clip_grad_norm(model)
