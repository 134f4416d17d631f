"""`hftrain export CKPT --out DIR`: any hftrain checkpoint -> one standard HF model directory.

A checkpoint written by DDP or one process already holds `model.safetensors`; an FSDP checkpoint holds
sharded weights (consolidated with accelerate's merge_fsdp_weights); a DeepSpeed ZeRO checkpoint holds
partitioned fp32 state (consolidated with DeepSpeed's zero_to_fp32). Plain transformers loads the result.

The checkpoint is checked first (its files against its marker's record, integrity.py; the weights' headers), so a
damaged one is one message before anything is written. The model is written into a staging directory beside
--out and renamed into place whole: a failure leaves no --out, and of two exports into one --out at the same time
one is refused (rename succeeds only onto a missing or empty directory) instead of mixing their files.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hftrain.checkpoint.files import check_weights
from hftrain.checkpoint.integrity import check_files
from hftrain.errors import HftrainError

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def export(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    if not checkpoint.is_dir():
        raise HftrainError(f"{checkpoint}: no such checkpoint directory.")
    if out.exists() and not out.is_dir():
        raise HftrainError(f"--out {out}: is a file; give a new directory to write the model into.")
    check_files(checkpoint)  # any format: a missing or cut-short shard, partition or adapter is named here
    check_weights(checkpoint)  # a truncated or placeholder model.safetensors is not exported as if it were a model
    _refuse_full(out)
    staged = _staging(out)
    try:
        _write(checkpoint, staged, merge)
        _move_into_place(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def _write(checkpoint: Path, out: Path, merge: bool) -> None:
    """The standard model directory for `checkpoint`, written into `out` (an empty staging directory)."""
    from hftrain.checkpoint.adapter import is_adapter_dir, merge_adapter

    if is_adapter_dir(checkpoint):
        if not merge:
            raise HftrainError(
                f"{checkpoint}: a LoRA adapter checkpoint; add --merge to write base + adapter as one model."
            )
        merge_adapter(checkpoint, out, tokenizer_dir=checkpoint)
        return
    fsdp = sorted(checkpoint.glob("pytorch_model_fsdp_*"))
    if fsdp and (checkpoint / "config.json").is_file():
        import tempfile

        from hftrain.checkpoint.adapter import fsdp_adapter

        with tempfile.TemporaryDirectory(prefix="hftrain-adapter-") as tmp:
            adapter = _consolidating(checkpoint, lambda: fsdp_adapter(checkpoint, fsdp[0], Path(tmp)))
            if adapter is not None:
                if not merge:
                    raise HftrainError(
                        f"{checkpoint}: a LoRA adapter checkpoint (sharded by FSDP); add --merge to write base + "
                        "adapter as one model."
                    )
                merge_adapter(adapter, out, tokenizer_dir=checkpoint)
                return
    if not (checkpoint / "config.json").is_file():
        raise HftrainError(f"{checkpoint}: not an hftrain checkpoint or model directory (no config.json).")
    if fsdp:
        from accelerate.utils import merge_fsdp_weights

        _consolidating(checkpoint, lambda: merge_fsdp_weights(str(fsdp[0]), str(out), safe_serialization=True))
    elif (checkpoint / "latest").is_file():  # DeepSpeed
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        _consolidating(
            checkpoint,
            lambda: convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(out), safe_serialization=True),
        )
    elif not list(checkpoint.glob("model*.safetensors")):
        raise HftrainError(
            f"{checkpoint}: no weights found (model.safetensors, FSDP shards or a DeepSpeed checkpoint)."
        )
    for name in MODEL_FILES + TOKENIZER_FILES:
        if (checkpoint / name).is_file() and not (out / name).exists():
            shutil.copy2(checkpoint / name, out / name)
    for shard in checkpoint.glob("model-*.safetensors"):
        shutil.copy2(shard, out / shard.name)


def _consolidating(checkpoint: Path, convert: Callable[[], Any]) -> Any:
    """Run a consolidation (accelerate's or DeepSpeed's reader); what it raises reading a damaged shard (EOFError,
    a zip or unpickling error, torch.distributed.checkpoint's CheckpointException) becomes one message. A
    checkpoint with a record was checked before; one written by older hftrain has none, so its damage shows here."""
    try:
        return convert()
    except BaseException as err:
        failures = getattr(err, "failures", None)  # CheckpointException (a BaseException): {rank: (error, trace)}
        if isinstance(err, (HftrainError, OSError, MemoryError)) or not (isinstance(err, Exception) or failures):
            raise
        cause = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else err
        first = (str(cause).strip().splitlines() or [""])[0].split(". ")[0][:300]
        raise HftrainError(
            f"{checkpoint}: could not read its sharded state ({type(cause).__name__}{': ' + first if first else ''}). "
            "A shard or partition is damaged or cut short; restore it from a copy, or export an earlier checkpoint."
        ) from None


def _refuse_full(out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):
        raise HftrainError(f"--out {out}: exists and is not empty; give a new directory.")


def _staging(out: Path) -> Path:
    """An empty directory beside --out (same file system, so the final rename is atomic), named for this process."""
    staged = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        shutil.rmtree(staged, ignore_errors=True)  # left by a killed export that had this process id
        staged.mkdir(parents=True)
    except OSError as err:
        raise HftrainError(
            f"--out {out}: cannot create {staged} beside it ({err.strerror or err}); give a directory you can write."
        ) from None
    return staged


def _move_into_place(staged: Path, out: Path) -> None:
    """rename(2) onto a missing or empty --out; it fails if --out has been filled meanwhile (another export)."""
    try:
        os.rename(staged, out)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise HftrainError(
                f"--out {out}: was filled by something else (another export?) while this export ran; "
                "this export kept nothing. Give a new directory."
            ) from None
        raise HftrainError(
            f"--out {out}: cannot move the exported model into place ({err.strerror or err}); "
            "give a new directory on a file system you can write."
        ) from None
