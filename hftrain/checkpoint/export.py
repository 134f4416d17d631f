"""`hftrain export CKPT --out DIR`: any hftrain checkpoint -> one standard HF model directory.

A checkpoint written by DDP or one process already holds `model.safetensors`; an FSDP checkpoint holds
sharded weights (consolidated with accelerate's merge_fsdp_weights); a DeepSpeed ZeRO checkpoint holds
partitioned fp32 state (consolidated with DeepSpeed's zero_to_fp32). Plain transformers loads the result.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hftrain.errors import HftrainError
from hftrain.checkpoint.files import check_weights

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def export(checkpoint: Path, out: Path, merge: bool = False) -> Path:
    from hftrain.checkpoint.adapter import is_adapter_dir, merge_adapter

    if not checkpoint.is_dir():
        raise HftrainError(f"{checkpoint}: no such checkpoint directory.")
    if out.exists() and not out.is_dir():
        raise HftrainError(f"--out {out}: is a file; give a new directory to write the model into.")
    if is_adapter_dir(checkpoint):
        if not merge:
            raise HftrainError(f"{checkpoint}: a LoRA adapter checkpoint; add --merge to write base + adapter as one model.")
        _new_out(out)
        return merge_adapter(checkpoint, out, tokenizer_dir=checkpoint)
    fsdp = sorted(checkpoint.glob("pytorch_model_fsdp_*"))
    if fsdp and (checkpoint / "config.json").is_file():
        import tempfile

        from hftrain.checkpoint.adapter import fsdp_adapter

        with tempfile.TemporaryDirectory(prefix="hftrain-adapter-") as tmp:
            adapter = fsdp_adapter(checkpoint, fsdp[0], Path(tmp))
            if adapter is not None:
                if not merge:
                    raise HftrainError(f"{checkpoint}: a LoRA adapter checkpoint (sharded by FSDP); add --merge to write base + adapter as one model.")
                _new_out(out)
                return merge_adapter(adapter, out, tokenizer_dir=checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise HftrainError(f"{checkpoint}: not an hftrain checkpoint or model directory (no config.json).")
    check_weights(checkpoint)  # a truncated or placeholder model.safetensors is not exported as if it were a model
    _new_out(out)
    deepspeed = (checkpoint / "latest").is_file()
    if fsdp:
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(fsdp[0]), str(out), safe_serialization=True)
    elif deepspeed:
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(out), safe_serialization=True)
    elif not list(checkpoint.glob("model*.safetensors")):
        raise HftrainError(f"{checkpoint}: no weights found (model.safetensors, FSDP shards or a DeepSpeed checkpoint).")
    for name in MODEL_FILES + TOKENIZER_FILES:
        if (checkpoint / name).is_file() and not (out / name).exists():
            shutil.copy2(checkpoint / name, out / name)
    for shard in checkpoint.glob("model-*.safetensors"):
        shutil.copy2(shard, out / shard.name)
    return out


def _new_out(out: Path) -> None:
    """--out is a new (or empty) directory, created here."""
    if out.exists() and any(out.iterdir()):
        raise HftrainError(f"--out {out}: exists and is not empty; give a new directory.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise HftrainError(f"--out {out}: cannot create it ({err.strerror or err}); give a directory you can write.") from None
