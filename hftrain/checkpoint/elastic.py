"""Model and optimizer state when a run resumes on another process count ("elastic resume"), per backend.

What each backend's checkpoint needs to load on N processes when M wrote it (seen with torch 2.13,
accelerate 1.15, DeepSpeed 0.19, transformers 5.23):

* single / DDP: model.safetensors and optimizer.pt hold full tensors and load on any count. Only the RNG
  files are named by count (``rng_state.pth`` for one process, ``rng_state_<rank>.pth`` for several) and the
  Trainer silently skips a name it does not find: ``load_rng_state`` gives every process the writer's rank-0
  state (the Trainer seeds every rank alike, so that is what an uninterrupted run on the new count has).
* FSDP2 (SHARDED_STATE_DICT): torch.distributed.checkpoint stores global shapes and reshards on load;
  nothing to do here.
* ZeRO-3: DeepSpeed refuses another data-parallel size ("Automatic adjustment of ZeRO's optimizer state
  partitioning with a new world size is not currently supported"). ``prepare_resume`` converts the checkpoint
  to DeepSpeed's universal format (``deepspeed.checkpoint.ds_to_universal``) inside it, beside the original
  files (which stay untouched), and turns on ``checkpoint.load_universal`` in the DeepSpeed config.

Each format loads only under the backend that wrote it, so a backend switch is refused (``check_backend``)
with one message; single and DDP share a format. The writer's backend and world size are recorded in the
checkpoint's completion marker (CheckpointManager.save); older checkpoints are judged by their files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain import _compat
from hftrain.checkpoint.integrity import loadable
from hftrain.checkpoint.layout import COMPLETE_MARKER
from hftrain.checkpoint.resume import ResumeSetting
from hftrain.errors import HftrainError
from hftrain.parallel.dims import Strategy

HOW = {  # how to launch a run that continues a checkpoint of each state format (any process count)
    "full": "plain `hftrain train RECIPE` (one process) or `hftrain train RECIPE --accelerate-config ddp --nproc N`",
    "fsdp": "`hftrain train RECIPE --accelerate-config fsdp --nproc N`",
    "zero3": "`hftrain train RECIPE --accelerate-config zero3 --nproc N`",
}
UNIVERSAL_TAG = "universal"  # checkpoint-N/universal/: the ZeRO-3 state in DeepSpeed's universal format
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's name: load_checkpoint reads the universal tag from it
UNIVERSAL_PARTIAL = ".universal-partial"  # a conversion in progress (a kill leaves it; the next start redoes it)


@dataclass(frozen=True)
class Written:
    """How a checkpoint was written: strategy (None when older hftrain did not record it), state format
    (full | fsdp | zero3), process count (None when unknown) and whether the format was judged by the files."""

    strategy: str | None
    format: str
    world_size: int | None
    from_files: bool

    @property
    def label(self) -> str:
        if self.strategy is not None:
            return Strategy(self.strategy).long_label
        return {"full": "single-process/DDP", "fsdp": "FSDP", "zero3": "DeepSpeed ZeRO-3"}[self.format]


def written_by(checkpoint: Path) -> Written:
    """The writer of `checkpoint`, from its marker, else from its files."""
    try:
        marker = json.loads((checkpoint / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = {}
    strategy = marker.get("strategy")
    world_size = marker.get("world_size") or _world_size_from_files(checkpoint)
    if strategy in {s.value for s in Strategy}:
        return Written(strategy, Strategy(strategy).state_format, world_size, from_files=False)
    return Written(None, format_of_files(checkpoint), world_size, from_files=True)


def format_of_files(checkpoint: Path) -> str:
    """fsdp: accelerate's sharded (pytorch_model_fsdp_0/) or full (pytorch_model_fsdp.bin) FSDP save;
    zero3: a DeepSpeed tag folder (global_stepN/); else full (model.safetensors + optimizer.pt)."""
    if any(checkpoint.glob("pytorch_model_fsdp*")) or any(p.is_dir() for p in checkpoint.glob("optimizer_*")):
        return "fsdp"
    if any(p.is_dir() for p in checkpoint.glob("global_step*")):
        return "zero3"
    return "full"


def _world_size_from_files(checkpoint: Path) -> int | None:
    ranks = list(checkpoint.glob("rng_state_*.pth"))
    return len(ranks) if ranks else 1 if (checkpoint / "rng_state.pth").is_file() else None


def check_backend(checkpoint: Path, strategy: Strategy | str, world_size: int | None) -> Written:
    """Refuse to resume `checkpoint` under another backend's format (one message saying what to do);
    returns how it was written. Another process count is fine."""
    strategy = Strategy(strategy)
    written = written_by(checkpoint)
    if written.format == strategy.state_format:
        return written
    how = "judged from its files" if written.from_files else "recorded in its " + COMPLETE_MARKER
    count = f", {written.world_size} process(es)" if written.world_size else ""
    now = f" ({world_size} process(es))" if world_size else ""
    raise HftrainError(
        f"{checkpoint}: written by {written.label} ({how}{count}), but this run is launched as "
        f"{strategy.long_label}{now}. A checkpoint's model and optimizer state load only under the backend that "
        f"wrote it (the process count may change). Continue this run with {HOW[written.format]}; or start over "
        "with training.resume_from_checkpoint=false (the earlier run is moved aside), or in a new training.output_dir."
    )


def check_before_launch(setting: ResumeSetting, output_dir: Path, strategy: Strategy, nproc: int | None) -> None:
    """The backend check, and an explicit resume path's readability, once before any process starts (so a refusal
    is one message, not one per rank). `setting`: training.resume_from_checkpoint, parsed."""
    if setting.mode == "path":
        loadable(setting.path)
    checkpoint = setting.checkpoint_in(output_dir)
    if checkpoint is not None:
        check_backend(checkpoint, strategy, nproc)


# ------------------------------------------------------------------------------------------- ZeRO-3
def prepare_resume(trainer: Any, checkpoint: Path) -> None:
    """Before trainer.train(): a ZeRO-3 checkpoint written by another process count is converted to the
    universal format (rank 0; the others wait) and the DeepSpeed config told to load it."""
    if not trainer.is_deepspeed_enabled:
        return
    written = written_by(checkpoint)
    if written.format != "zero3" or written.world_size == trainer.args.world_size:
        return
    if trainer.args.process_index == 0:
        if not universal_ready(checkpoint):
            print(
                f"hftrain: {checkpoint} was written by {written.world_size} process(es), this run has "
                f"{trainer.args.world_size}: converting its ZeRO-3 state to DeepSpeed's universal format "
                f"({checkpoint / UNIVERSAL_TAG})",
                flush=True,
            )
            convert_to_universal(checkpoint)
    trainer.accelerator.wait_for_everyone()
    if not universal_ready(checkpoint):  # e.g. an output_dir that is not shared between the nodes
        raise HftrainError(
            f"{checkpoint / UNIVERSAL_TAG}: the universal checkpoint written by rank 0 is not visible "
            "to this process. Put training.output_dir on storage every node shares."
        )
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    config.setdefault("checkpoint", {})["load_universal"] = True


def universal_load_fixes(checkpoint: Path, strategy: str, world_size: int) -> Any:
    """The callback that puts right what DeepSpeed's universal load gets wrong (_compat.universal_load_fixes), for
    a ZeRO-3 run resuming `checkpoint` written by another process count (prepare_resume converts it before
    training); None for any other resume. Given to the Trainer at construction (training/trainer_build.py)."""
    written = written_by(checkpoint)
    if strategy != "zero3" or written.format != "zero3" or written.world_size == world_size:
        return None
    return _compat.universal_load_fixes(checkpoint / UNIVERSAL_TAG / "zero" / "optimizer_state.pt")


def universal_ready(checkpoint: Path) -> bool:
    """A finished conversion: DeepSpeed's latest_universal is written last."""
    return (checkpoint / LATEST_UNIVERSAL).is_file() and (checkpoint / UNIVERSAL_TAG / "zero").is_dir()


def convert_to_universal(checkpoint: Path) -> None:
    """ds_to_universal of the checkpoint's ZeRO-3 tag folder into checkpoint/universal/. The original files are
    only read. Written under .universal-partial/ first and moved into place; latest_universal (what DeepSpeed
    reads to find the tag) comes last, so a kill at any point leaves a partial conversion that the next start
    removes and redoes."""
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    for leftover in (checkpoint / UNIVERSAL_PARTIAL, checkpoint / UNIVERSAL_TAG, checkpoint / LATEST_UNIVERSAL):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        elif leftover.exists():
            leftover.unlink()
    source = zero_tag_folder(checkpoint)
    work = checkpoint / UNIVERSAL_PARTIAL
    try:
        work.mkdir()
        ds_to_universal(
            argparse.Namespace(
                input_folder=str(source),
                output_folder=str(work / UNIVERSAL_TAG),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=False,
            )
        )
        os.replace(work / UNIVERSAL_TAG, checkpoint / UNIVERSAL_TAG)
        partial = checkpoint / f"{LATEST_UNIVERSAL}.partial"
        partial.write_text(UNIVERSAL_TAG, encoding="utf-8")
        os.replace(partial, checkpoint / LATEST_UNIVERSAL)
    except OSError as err:
        raise HftrainError(
            f"{checkpoint}: could not write its universal conversion ({err.strerror or err}); resuming a ZeRO-3 "
            "checkpoint on another process count needs room and write permission in the checkpoint directory. "
            "Or resume it with the process count that wrote it."
        ) from None
    shutil.rmtree(work, ignore_errors=True)


def zero_tag_folder(checkpoint: Path) -> Path:
    """The ZeRO files' folder: the tag named in DeepSpeed's `latest` file, else the one global_step* folder."""
    latest = checkpoint / "latest"
    if latest.is_file():
        return checkpoint / latest.read_text(encoding="utf-8").strip()
    folders = sorted(p for p in checkpoint.glob("global_step*") if p.is_dir())
    if len(folders) != 1:
        raise HftrainError(
            f"{checkpoint}: no DeepSpeed `latest` file and {len(folders)} global_step* folders; cannot tell which "
            "ZeRO-3 state to convert."
        )
    return folders[0]


# ---------------------------------------------------------------------------------------------- RNG
def load_rng_state(trainer: Any, checkpoint: str | None) -> bool:
    """On another process count, every process takes the writer's rank-0 RNG state (the Trainer's own loader
    would look for a file name the writer did not use, and silently skip it). False: same count, the
    Trainer's loader applies."""
    if checkpoint is None:
        return False
    path = Path(checkpoint)
    written = written_by(path)
    if written.world_size in (None, trainer.args.world_size):
        return False
    source = next((f for f in (path / "rng_state_0.pth", path / "rng_state.pth") if f.is_file()), None)
    if source is None:
        return False
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():  # numpy's RNG state, as the Trainer loads it
        state = torch.load(source, weights_only=True)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if (
        cuda is not None and torch.cuda.is_available()
    ):  # saved per device (distributed) or for all devices (one process)
        torch.cuda.random.set_rng_state(cuda[0] if isinstance(cuda, (list, tuple)) else cuda)
    return True
