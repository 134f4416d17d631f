"""A LoRA adapter on disk: its exact base model, merging it into that base, and consolidating an FSDP-sharded one.

An adapter records its exact base model: path and a fingerprint of the base weights (alignment-handbook#99),
so merging onto another base is refused instead of silently producing a different model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from hftrain.checkpoint.layout import BASE_FILE, RECIPE_FILE
from hftrain.errors import HftrainError
from hftrain.recipe.load import read_sections

# Linear layers LoRA adapts by default, per architecture (all attention and MLP projections).
DEFAULT_TARGETS = {"gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]}


def base_fingerprint(base: str) -> dict[str, Any]:
    """Identify the exact base weights: a hash of config.json and of each weights file's size and first MiB."""
    root = Path(base)
    digest = hashlib.sha256()
    if root.is_dir():
        for file in sorted(root.glob("config.json")) + sorted(root.glob("*.safetensors")):
            digest.update(file.name.encode())
            digest.update(str(file.stat().st_size).encode())
            with file.open("rb") as f:
                digest.update(f.read(1 << 20))
    return {"base_model": base, "fingerprint": digest.hexdigest()[:16] if root.is_dir() else None}


def save_adapter(model: Any, directory: Path, base: str, state_dict: dict[str, Any] | None = None) -> None:
    model.save_pretrained(directory, state_dict=state_dict)
    (directory / BASE_FILE).write_text(json.dumps(base_fingerprint(base), indent=2), encoding="utf-8")


def merge_adapter(adapter_dir: Path, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """Base weights (full precision, never the quantized copy) + adapter -> one standard HF model directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    base = config["base_model_name_or_path"]
    recorded = adapter_dir / BASE_FILE
    if recorded.is_file():
        expected = json.loads(recorded.read_text())["fingerprint"]
        if expected and base_fingerprint(base)["fingerprint"] != expected:
            raise HftrainError(
                f"{adapter_dir}: the base model at {base} is not the "
                "one this adapter was trained on (fingerprint differs)."
            )
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except OSError as err:
        raise HftrainError(
            f"{adapter_dir}: cannot load its base model {base!r} ({str(err).splitlines()[0]})."
        ) from None
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    tok_source = tokenizer_dir if tokenizer_dir and (tokenizer_dir / "tokenizer_config.json").is_file() else Path(base)
    AutoTokenizer.from_pretrained(tok_source).save_pretrained(out)
    return out


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def fsdp_adapter(checkpoint: Path, shards: Path, out: Path) -> Path | None:
    """An FSDP LoRA checkpoint holds the adapter sharded: consolidate it into a peft adapter directory
    (config from the checkpoint's recipe), or None when the checkpoint is not a LoRA run's."""
    if not (checkpoint / RECIPE_FILE).is_file():
        return None
    finetune, model = read_sections(checkpoint / RECIPE_FILE, "finetune", "model")  # how its run fine-tuned
    if finetune.method == "full":
        return None
    from accelerate.utils import merge_fsdp_weights
    from peft import LoraConfig

    merge_fsdp_weights(str(shards), str(out), safe_serialization=True)
    (out / "model.safetensors").rename(out / "adapter_model.safetensors")
    options = dict(finetune.lora)
    model_type = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["model_type"]
    targets = options.pop("target_modules", None) or DEFAULT_TARGETS.get(model_type)
    base = model.from_pretrained or ""
    LoraConfig(task_type="CAUSAL_LM", target_modules=targets, base_model_name_or_path=base, **options).save_pretrained(
        out
    )
    if (checkpoint / BASE_FILE).is_file():
        shutil.copy2(checkpoint / BASE_FILE, out / BASE_FILE)
    return out
