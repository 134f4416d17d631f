"""The CheckpointManager: one owner for every piece of a run's saved state.

What a checkpoint holds, and who writes it:
* weights, optimizer, scheduler, RNG and trainer state: the Trainer's own save, called by ``save``;
* each process's data position (``hftrain_data_state-rankN.json``): ``save``;
* the resolved recipe (secrets removed), a LoRA adapter's exact base, config + tokenizer for sharded saves:
  ``_write_extras``.
A checkpoint is written into ``output_dir/.staging/checkpoint-N`` and renamed into place only once all of
that is there, then marked complete: the marker records every file's size (integrity.py), which a resume and
`hftrain export` check before trusting the checkpoint. A kill during a save leaves a staging directory that the
next start removes; ``checkpoint-N`` directories without the marker (copied by hand, half-deleted) are never
resumed from. Rotation (``save_total_limit``) happens here, after the new checkpoint is complete; the checkpoints
recipe.checkpoints keeps for study (Pythia-style schedules) are never rotated.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from hftrain.checkpoint.adapter import base_fingerprint, is_adapter_dir
from hftrain.checkpoint.files import read_json
from hftrain.checkpoint.integrity import RECORD, loadable, record, unreadable
from hftrain.checkpoint.layout import (
    BASE_FILE,
    COMPLETE_MARKER,
    DATA_STATE_GLOB,
    RECIPE_FILE,
    RunLayout,
    checkpoint_step,
    data_state_file,
)
from hftrain.checkpoint.node_disks import checkpoint_listing
from hftrain.checkpoint.output_lock import writable_directory
from hftrain.checkpoint.resume import complete_checkpoints, latest_checkpoint
from hftrain.checkpoint.weights import load_checkpoint_weights, save_full_model
from hftrain.errors import HftrainError
from hftrain.parallel.dims import ParallelDims
from hftrain.recipe.sections import CheckpointsSection

if TYPE_CHECKING:
    from hftrain.checkpoint.part import CheckpointPart


def publish(staged: Path, target: Path, info: dict[str, Any], files: dict[str, Any] | None = None) -> None:
    """Mark a fully written staging directory complete and move it into place. The marker holds `info` and the
    record of its files (integrity.py; `files`: gathered already, else this process lists `staged`). A directory
    already there is replaced only if hftrain wrote it (it holds the marker), after moving it aside: a kill at any
    point leaves the old or the new one complete."""
    marker = {**info, RECORD: files if files is not None else record(staged)}
    (staged / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2), encoding="utf-8")
    if target.exists() and not (target / COMPLETE_MARKER).is_file():
        raise HftrainError(
            f"{target}: already exists and was not written by hftrain (no {COMPLETE_MARKER}), so it stays as it is. "
            "Move it out of training.output_dir, then run the same command again to continue."
        )
    replaced = staged.parent / f"replaced-{target.name}"
    if target.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(target, replaced)
    os.replace(staged, target)
    shutil.rmtree(replaced, ignore_errors=True)
    try:
        staged.parent.rmdir()  # only if no other save is in progress
    except OSError:
        pass


FULL_DISK_SIGNS = ("No space left", "file write failed", "StorageFull", "unexpected pos", "Disk quota exceeded")
"""How writers that raise no OSError report a full disk: torch.save's RuntimeError (PytorchStreamWriter "file write
failed", "unexpected pos"), safetensors' SafetensorError (IoError ... StorageFull)."""


def write_failure(err: BaseException) -> str | None:
    """Why a checkpoint write failed, in words, when it is the disk's doing (full, quota, permissions); None for
    anything else, which keeps its own error."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    first = (str(err).splitlines() or [""])[0][:200]
    if any(sign in str(err) for sign in FULL_DISK_SIGNS):
        return f"the disk is full or refused a write: {type(err).__name__}: {first}"
    return None


class CheckpointManager:
    """Staging, publishing, rotation, resume and the final model of one run directory."""

    def __init__(self, part: CheckpointPart, dims: ParallelDims | None):
        # the run directory and training.resume_from_checkpoint (parsed once) are the part's
        self.layout, self.part, self.resume = RunLayout(part.output_dir), part, part.resume
        # the run's parallel dims: its strategy and nodes, for what a save writes; None for a manager that only reads
        # the directory (the resolver's: what the run recorded, whether it is the same run), which cannot save
        self.dims = dims
        self.keep = part.save_total_limit
        self.on_publish: list[Callable[[Path], None]] = []  # e.g. the hub pusher: called with each new checkpoint

    # ----------------------------------------------------------------------------- start of a run
    def recorded_start(self) -> dict[str, Any]:
        """What this run recorded when it started, for a run that continues (empty otherwise): the speed levers
        (bf16, compile, ...), the global batch, the data readers and their shuffle window. Exact resume needs the same
        precision and compile choices, and the same data order and sequences per step, whatever the new launch would
        choose."""
        if self._starts_over():
            return {}
        record = self._run_record()
        if record.get("fingerprint") != self.part.identity or not self.complete():
            return {}
        return {
            key: record[key]
            for key in ("speed", "global_batch", "readers", "shuffle_window")
            if record.get(key) is not None
        }

    def _run_record(self) -> dict[str, Any]:
        try:
            return json.loads(self.layout.run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def claim(self, is_main: bool, start: dict[str, Any]) -> None:
        """Refuse an output_dir that holds a different run (model, tokenizer or data) or a final/ hftrain did not
        write; record ours (`start`: speed levers, global batch, readers; see recorded_start) otherwise, and remove what
        interrupted saves left behind. Starting over (resume_from_checkpoint=false) moves the earlier run aside
        first."""
        run_file, mine, final = self.layout.run_file, self.part.identity, self.layout.final
        if final.exists() and not (final / COMPLETE_MARKER).is_file():
            raise HftrainError(
                f"training.output_dir: {final} was not written by hftrain (it has no {COMPLETE_MARKER}); this run "
                "would replace it with its own final model. Move it "
                "elsewhere, or set training.output_dir to another directory."
            )
        if is_main and self._starts_over() and (self.complete() or final.is_dir()):
            print(
                f"hftrain: training.resume_from_checkpoint=false: moved the earlier run to {self._move_aside()}",
                flush=True,
            )
        self.check_same_run()
        if not is_main:
            return
        writable_directory(self.layout.root)
        partial = run_file.with_suffix(".tmp")
        partial.write_text(json.dumps({"fingerprint": mine, **start}, indent=2), encoding="utf-8")
        os.replace(partial, run_file)  # other processes never read a half-written file
        if self.layout.staging.is_dir():
            for leftover in sorted(self.layout.staging.iterdir()):
                print(f"hftrain: removed {leftover} (an interrupted save)")
            shutil.rmtree(self.layout.staging, ignore_errors=True)

    def check_same_run(self) -> None:
        """Refuse an output_dir whose run (checkpoints or final model) has another model, tokenizer or data: when the
        run is resolved (training/resolve.py), before its speed probe, tokenizer and model, and again when the
        directory is claimed."""
        if not self.layout.run_file.is_file():
            return
        theirs = self._run_record().get("fingerprint", {})
        differ = [part for part in ("model", "tokenizer", "data") if theirs.get(part) != self.part.identity[part]]
        if differ and (self.complete() or self.layout.final.is_dir()):
            root = self.layout.root
            raise HftrainError(
                f"training.output_dir: {root} holds a run whose {' and '.join(differ)} differ from this recipe's. "
                f"Continuing it would mix two runs. Set training.output_dir to a new directory, or delete {root} "
                "to start fresh. (Changing training settings such as max_steps or learning_rate continues a run.)"
            )

    def _starts_over(self) -> bool:
        return self.resume.mode == "never"

    def _move_aside(self) -> Path:
        """The earlier run's own files (complete checkpoints, final/, logs, results, and the uploads it still owed:
        its outbox, so the new run never sends them as its own) into previous-<UTC time>/; anything hftrain did not
        write stays where it is, and so does a trained tokenizer (it is reused, part of the directory's run identity
        like the data)."""
        layout = self.layout
        aside = layout.root / time.strftime("previous-%Y%m%dT%H%M%SZ", time.gmtime())
        aside.mkdir()
        own = [
            *self.complete(),
            layout.initial,
            layout.final,
            layout.metrics,
            layout.results,
            layout.plot,
            layout.report,
            layout.profile,
            layout.batches,
            layout.run_file,
            layout.outbox,
        ]
        for path in own:
            if path.exists():
                os.replace(path, aside / path.name)
        if (aside / layout.OUTBOX).is_dir():
            print(
                f"hftrain: the earlier run's unsent uploads stay its own: {aside / layout.OUTBOX} lists them "
                "(none is sent as this run's)",
                flush=True,
            )
        return aside

    def _write_recipe(self, staged: Path) -> None:
        """The recipe as run (secrets removed) beside the weights: a checkpoint explains itself."""
        (staged / RECIPE_FILE).write_text(self.part.recipe_yaml, encoding="utf-8")

    def complete(self) -> list[Path]:
        return complete_checkpoints(self.layout.root)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.layout.root)

    def resume_point(self, is_main: bool = True) -> Path | None:
        """Where the run continues: the newest complete checkpoint that loads, none, or the given path (which
        must load); see ResumeSetting."""
        setting = self.resume
        if setting.mode == "never":
            return None
        if setting.mode == "path":
            return loadable(setting.path)
        latest = self._newest_loadable(is_main)
        if latest is None and setting.mode == "required":
            raise HftrainError(
                f"training.resume_from_checkpoint: true, but {self.layout.root} holds no complete checkpoint."
            )
        return latest

    def _newest_loadable(self, is_main: bool) -> Path | None:
        """The newest complete checkpoint whose files read back. An unreadable one (a file missing or cut short
        against its marker's record, in any format; a corrupt state file) is renamed unreadable-checkpoint-N, byte
        for byte as it was, with a warning; only refusals (another run, backend or process count) are errors, and
        those come later, from a readable checkpoint. Every process judges the same files, before any loads them
        (run.py), so all agree; the main process alone moves the unreadable ones aside."""
        done = self.complete()
        for checkpoint in reversed(done):
            problem = unreadable(checkpoint)
            if problem is None:
                return checkpoint
            aside = checkpoint.with_name(f"unreadable-{checkpoint.name}")
            if is_main:
                os.replace(checkpoint, aside)
                print(
                    f"hftrain: warning: {checkpoint} cannot be loaded ({problem}); kept as {aside}, and the run "
                    "resumes from the newest checkpoint that loads.",
                    flush=True,
                )
        if done:
            raise HftrainError(
                f"training.output_dir: none of the checkpoints in {self.layout.root} can be loaded (see the warnings "
                "above); restore one, or set training.resume_from_checkpoint=false "
                "to start over (the earlier run is moved aside)."
            )
        return None

    # ------------------------------------------------------------------------------------ loading
    def load_weights(self, model: Any, checkpoint: Path) -> None:
        """Weights only (full model or adapter), strictly; the Trainer restores optimizer and RNG state."""
        load_checkpoint_weights(model, checkpoint)

    def data_positions(self, checkpoint: Path) -> list[dict[str, Any]]:
        """The data positions every process of the writing launch saved in `checkpoint` (any process count)."""
        files = sorted(checkpoint.glob(DATA_STATE_GLOB))
        return [read_json(f, "a process's data position") for f in files]

    # ------------------------------------------------------------------------------------- saving
    def save(self, trainer: Any, write_trainer_files: Callable[[], None], data_position: dict[str, Any] | None) -> None:
        """One checkpoint: the Trainer's files (written by `write_trainer_files` into layout.staging),
        this process's data position and the extras, then published complete and older ones rotated."""
        step, rank = trainer.state.global_step, trainer.args.process_index
        name = f"checkpoint-{step}"
        staged = self.layout.staged(name)
        try:
            write_trainer_files()
            if data_position is not None:
                (staged / data_state_file(rank)).write_text(json.dumps(data_position), encoding="utf-8")
        except Exception as err:  # disk full, unwritable, quota: the previous checkpoints are untouched
            raise self._write_error(err, staged, str(self.layout.root / name)) from None
        trainer.accelerator.wait_for_everyone()
        # node-local disks: every process takes part (node_disks.py)
        files, where = checkpoint_listing(staged, trainer.args, self.dims)
        if trainer.args.should_save:
            self._write_extras(staged, trainer)
            # the writer's backend and process count: how a resume judges the checkpoint (elastic.py)
            info = {"step": step, "world_size": trainer.args.world_size, "strategy": self.dims.strategy.value, **where}
            publish(staged, self.layout.checkpoint(step), info, files)
            self._rotate()
            for notify in self.on_publish:
                notify(self.layout.checkpoint(step))
        trainer.accelerator.wait_for_everyone()

    def _write_extras(self, staged: Path, trainer: Any) -> None:
        """What makes a checkpoint explain itself: the resolved recipe (secrets removed), an adapter's exact
        base, and for sharded saves the config and tokenizer."""
        self._write_recipe(staged)
        if is_adapter_dir(staged):
            base = base_fingerprint(self.part.base_model)
            (staged / BASE_FILE).write_text(json.dumps(base, indent=2), encoding="utf-8")
        elif not (staged / "config.json").is_file():
            trainer.accelerator.unwrap_model(trainer.model).config.save_pretrained(staged)
            trainer.processing_class.save_pretrained(staged)

    def _rotate(self) -> None:
        """Keep the newest `keep` complete checkpoints (None or <= 0: all), and those recipe.checkpoints keeps."""
        if not self.keep or self.keep <= 0:
            return
        rotating = [c for c in self.complete() if not self.part.kept.keeps(checkpoint_step(c) or -1)]
        for old in rotating[: -self.keep]:
            # a kill mid-delete leaves it in staging, removed at start
            doomed = self.layout.staged(f"rotated-{old.name}")
            doomed.parent.mkdir(parents=True, exist_ok=True)
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def save_initial(self, trainer: Any) -> Path | None:
        """Step 0 kept (Pythia's step0): the weights before step 1 as a model directory `initial/` (main process).
        Not for an adapter or a quantized base (the base model is step 0), nor ZeRO-3's partitioned parameters."""
        if not trainer.args.should_save:
            return None
        model = trainer.model
        if not self.part.full_weights or any(hasattr(p, "ds_id") for p in model.parameters()):
            print(
                "hftrain: checkpoints: step 0 is not saved for an adapter, a quantized base or ZeRO-3 (the base model, "
                "or partitioned weights); the other kept steps are.",
                flush=True,
            )
            return None
        staged = self.layout.staged(RunLayout.INITIAL)
        try:
            model.save_pretrained(staged, safe_serialization=True)
            trainer.processing_class.save_pretrained(staged)
            self._write_recipe(staged)
        except Exception as err:
            raise self._write_error(err, staged, "the initial weights (step 0)") from None
        publish(staged, self.layout.initial, {"step": 0})
        return self.layout.initial

    def stage_final(self, trainer: Any) -> Path:
        """Write the final model as one standard HF directory into staging (every process takes part in
        gathering a sharded model); `publish_final` moves it into final/ once its evaluation is known."""
        staged = self.layout.staged(RunLayout.FINAL)
        try:
            save_full_model(trainer, staged, self.part.base_model)
        except Exception as err:
            raise self._write_error(err, staged, "the final model") from None
        return staged

    def _write_error(self, err: Exception, staged: Path, what: str) -> Exception:
        """The error to raise for a failed write into `staged`: the disk's doing (write_failure) becomes one message
        naming the intact checkpoint, with the half-written staging removed; anything else is `err` itself."""
        reason = write_failure(err)
        if reason is None:
            return err
        shutil.rmtree(staged, ignore_errors=True)
        latest = self.latest()
        before = f"The last complete checkpoint {latest} is intact" if latest else "No earlier checkpoint exists"
        return HftrainError(
            f"training.output_dir: could not write {what} ({reason}). {before}; "
            "free space or fix permissions, then run the same command to resume."
        )

    def publish_final(self, staged: Path, info: dict[str, Any]) -> Path:
        """Main process: the staged final model, with its recipe, replaces final/ atomically."""
        self._write_recipe(staged)
        (staged / "training_args.bin").unlink(missing_ok=True)  # a pickle: not part of a shareable model
        publish(staged, self.layout.final, info)
        return self.layout.final


class KeptCheckpointsCallback(TrainerCallback):
    """A checkpoint at every step recipe.checkpoints keeps (Pythia's schedule, log-spaced, a list), besides
    save_steps' own; the CheckpointManager's rotation leaves these alone. The kept steps are listed once, when
    training starts (its max_steps known): a step only looks itself up."""

    def __init__(self, schedule: CheckpointsSection):
        self.schedule = schedule
        self.kept: frozenset[int] = frozenset()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.kept = frozenset(self.schedule.kept_steps(state.max_steps))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in self.kept:
            control.should_save = True
