"""Fine-tuning methods through peft and bitsandbytes: full, LoRA, QLoRA (4-bit NF4/FP4) and 8-bit LoRA.

A LoRA run trains a small adapter; its checkpoints hold the adapter only, and its final directory holds the
merged standard model (plus the adapter in final/adapter/), so plain transformers loads the result. The adapter
records its exact base model: path and a fingerprint of the base weights (alignment-handbook#99).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .errors import HftrainError
from .recipe_schema import Recipe

# Linear layers LoRA adapts by default, per architecture (all attention and MLP projections).
DEFAULT_TARGETS = {"gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]}
BASE_FILE = "hftrain_base.json"
QUANTIZED = ("qlora", "lora_8bit")


def quantization_config(recipe: Recipe) -> Any:
    method, q = recipe.finetune.method, recipe.finetune.quantization
    if method not in QUANTIZED:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HftrainError(f"finetune.method: {method} needs bitsandbytes: pip install 'hftrain[qlora]'") from None
    from transformers import BitsAndBytesConfig

    from .parallel import resolve_strategy

    storage = check_strategy(recipe, resolve_strategy(recipe))
    if method == "lora_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=q.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=getattr(torch, q.bnb_4bit_compute_dtype),
        bnb_4bit_quant_storage=getattr(torch, storage),
    )


def check_strategy(recipe: Recipe, strategy: str) -> str:
    """Refuse quantized methods with backends that cannot shard or partition bitsandbytes weights; returns the
    4-bit storage dtype: under FSDP it must be the compute dtype, or the packed uint8 weights stay unsharded.
    Called before processes are started (launch.py) and again in each process (accelerate launch)."""
    from .parallel import LABELS

    method, q = recipe.finetune.method, recipe.finetune.quantization
    if method not in QUANTIZED:
        return "uint8"
    where = f"finetune.method={method} with parallelism.strategy={strategy} ({LABELS[strategy]})"
    if strategy == "zero3":
        raise HftrainError(
            f"{where}: not supported. DeepSpeed ZeRO-3 partitions weights as the model is built (zero.Init), which does "
            "not support bitsandbytes' quantized weights (bitsandbytes#1249). Use --accelerate-config fsdp (qlora) or ddp, "
            "or finetune.method=lora with ZeRO-3."
        )
    if strategy == "fsdp" and method == "lora_8bit":
        raise HftrainError(
            f"{where}: FSDP cannot shard bitsandbytes' int8 weights. Use finetune.method=qlora with "
            f"finetune.quantization.bnb_4bit_quant_storage={q.bnb_4bit_compute_dtype}, or --accelerate-config ddp."
        )
    if strategy != "fsdp":
        return q.bnb_4bit_quant_storage or "uint8"
    if q.bnb_4bit_quant_storage not in (None, q.bnb_4bit_compute_dtype):
        raise HftrainError(
            f"finetune.quantization.bnb_4bit_quant_storage: {q.bnb_4bit_quant_storage} with FSDP; FSDP shards the 4-bit "
            f"weights only when they are stored as the compute dtype: set it to {q.bnb_4bit_compute_dtype} (or remove it)."
        )
    return q.bnb_4bit_compute_dtype


def quantized_device_map(recipe: Recipe) -> dict[str, Any] | None:
    """Each DDP/FSDP process loads its own quantized copy onto its own GPU, not all onto GPU 0 (transformers#21736)."""
    from .parallel import resolve_strategy

    if recipe.finetune.method not in QUANTIZED or not torch.cuda.is_available() or resolve_strategy(recipe) == "device_map":
        return None
    return {"": torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))}


def linear_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of the model's linear layers (quantized ones included)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def apply_method(model: Any, recipe: Recipe, gradient_checkpointing: bool) -> Any:
    """Wrap the model for its fine-tuning method (returns it unchanged for full training)."""
    method = recipe.finetune.method
    if method == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    options = dict(recipe.finetune.lora)
    targets = options.pop("target_modules", None) or DEFAULT_TARGETS.get(model.config.model_type)
    if not targets:
        raise HftrainError(f"finetune.lora.target_modules: no default for {model.config.model_type}; name the linear layers to adapt.")
    available = linear_names(model)
    unknown = [t for t in ([targets] if isinstance(targets, str) else targets) if t not in available]
    if unknown:
        raise HftrainError(
            f"finetune.lora.target_modules: {', '.join(unknown)} match no linear layer of this model; its linear layers are: {', '.join(available)}."
        )
    if method in QUANTIZED:
        from . import cpu_compat

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        cpu_compat.fix_bnb_4bit(model)
    try:
        config = LoraConfig(task_type="CAUSAL_LM", target_modules=targets, **options)
    except (TypeError, ValueError) as err:
        raise HftrainError(f"finetune.lora: {err}") from None
    # the adapter's random init, the same in every run and on every rank (FSDP and ZeRO-3 keep each rank's own part)
    torch.manual_seed(recipe.training.seed)
    return get_peft_model(model, config)


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
            raise HftrainError(f"{adapter_dir}: the base model at {base} is not the one this adapter was trained on (fingerprint differs).")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except OSError as err:
        raise HftrainError(f"{adapter_dir}: cannot load its base model {base!r} ({str(err).splitlines()[0]}).") from None
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    tok_source = tokenizer_dir if tokenizer_dir and (tokenizer_dir / "tokenizer_config.json").is_file() else Path(base)
    AutoTokenizer.from_pretrained(tok_source).save_pretrained(out)
    return out


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def copy_adapter(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name.startswith(("adapter_", BASE_FILE)):
            shutil.copy2(item, dst / item.name)


def fsdp_adapter(checkpoint: Path, shards: Path, out: Path) -> Path | None:
    """An FSDP LoRA checkpoint holds the adapter sharded: consolidate it into a peft adapter directory
    (config from the checkpoint's recipe), or None when the checkpoint is not a LoRA run's."""
    from .checkpoint import RECIPE_FILE
    from .recipe import load_recipe

    if not (checkpoint / RECIPE_FILE).is_file():
        return None
    recipe = load_recipe(str(checkpoint / RECIPE_FILE), [])
    if recipe.finetune.method == "full":
        return None
    from accelerate.utils import merge_fsdp_weights
    from peft import LoraConfig

    merge_fsdp_weights(str(shards), str(out), safe_serialization=True)
    (out / "model.safetensors").rename(out / "adapter_model.safetensors")
    options = dict(recipe.finetune.lora)
    model_type = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))["model_type"]
    targets = options.pop("target_modules", None) or DEFAULT_TARGETS.get(model_type)
    base = recipe.model.from_pretrained or ""
    LoraConfig(task_type="CAUSAL_LM", target_modules=targets, base_model_name_or_path=base, **options).save_pretrained(out)
    if (checkpoint / BASE_FILE).is_file():
        shutil.copy2(checkpoint / BASE_FILE, out / BASE_FILE)
    return out
