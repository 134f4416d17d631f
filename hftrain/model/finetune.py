"""Fine-tuning methods through peft and bitsandbytes: full, LoRA, QLoRA (4-bit NF4/FP4) and 8-bit LoRA.

A LoRA run trains a small adapter; its checkpoints hold the adapter only, and its final directory holds the
merged standard model (plus the adapter in final/adapter/), so plain transformers loads the result
(adapter.py: saving, base fingerprint, merging).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hftrain import _compat
from hftrain.checkpoint.adapter import DEFAULT_TARGETS
from hftrain.errors import HftrainError
from hftrain.parallel.dims import ParallelDims, Strategy
from hftrain.recipe.objectives import OBJECTIVES

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart

QUANTIZED = ("qlora", "lora_8bit")


def quantization_config(part: ModelPart, strategy: Strategy) -> Any:
    method, q = part.finetune.method, part.finetune.quantization
    if method not in QUANTIZED:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HftrainError(f"finetune.method: {method} needs bitsandbytes: pip install 'hftrain[qlora]'") from None
    from transformers import BitsAndBytesConfig

    storage = check_strategy(part, strategy)
    if method == "lora_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=q.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=getattr(torch, q.bnb_4bit_compute_dtype),
        bnb_4bit_quant_storage=getattr(torch, storage),
    )


def check_starting_weights(part: ModelPart) -> None:
    """Methods that need trained weights to start from, refused on a preset's random ones before training (`hftrain
    plan` still sizes such a recipe: its memory is the pretrained model's of the same shape). A LoRA adapter is
    merged into and loaded with saved weights that no file holds for a preset (its final merge would fail after the
    whole run); DPO moves a policy away from a reference by their preferences, and random weights prefer nothing."""
    if part.from_pretrained:
        return
    preset = part.preset
    goal = OBJECTIVES[part.finetune.objective]
    if goal.trained_weights:
        raise HftrainError(
            f"finetune.objective: {goal.name} {goal.trained_weights}, but this recipe builds model.preset {preset} "
            "from random weights (no model.from_pretrained), which prefer nothing: the run would train a random policy "
            "against a random reference. Set model.from_pretrained to a checkpoint directory or Hub id (a pretraining "
            "or fine-tuning run's final/ will do), or pretrain with finetune.objective: lm first."
        )
    if part.finetune.method == "lora":
        raise HftrainError(
            f"finetune.method: lora trains an adapter onto pretrained weights, but this recipe builds model.preset "
            f"{preset} from random weights (no model.from_pretrained). Set model.from_pretrained to a "
            "checkpoint directory or Hub id (a pretraining run's final/ will do), or train every weight with "
            "finetune.method: full."
        )


def check_strategy(part: ModelPart, strategy: Strategy) -> str:
    """Refuse quantized methods with backends that cannot shard or partition bitsandbytes weights; returns the
    4-bit storage dtype: under FSDP it must be the compute dtype, or the packed uint8 weights stay unsharded.
    Called before processes are started (launch/processes.py) and again in each process (accelerate launch)."""
    method, q = part.finetune.method, part.finetune.quantization
    if method not in QUANTIZED:
        return "uint8"
    where = f"finetune.method={method} with parallelism.strategy={strategy} ({Strategy(strategy).label})"
    if strategy == "zero3":
        raise HftrainError(
            f"{where}: not supported. DeepSpeed ZeRO-3 partitions weights as the model is built (zero.Init), which "
            "does not support bitsandbytes' quantized weights (bitsandbytes#1249). Use --accelerate-config fsdp "
            "(qlora) or ddp, or finetune.method=lora with ZeRO-3."
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
            f"finetune.quantization.bnb_4bit_quant_storage: {q.bnb_4bit_quant_storage} with FSDP; FSDP shards the "
            "4-bit weights only when they are stored as the compute "
            f"dtype: set it to {q.bnb_4bit_compute_dtype} (or remove it)."
        )
    return q.bnb_4bit_compute_dtype


def quantized_device_map(part: ModelPart, dims: ParallelDims | None) -> dict[str, Any] | None:
    """Each DDP/FSDP process loads its own quantized copy onto its own GPU, not all onto GPU 0 (transformers#21736)."""
    if part.finetune.method not in QUANTIZED or not torch.cuda.is_available():
        return None
    if dims is not None and dims.strategy is Strategy.DEVICE_MAP:
        return None
    return {"": torch.device("cuda", dims.local_rank if dims is not None else 0)}


def linear_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of the model's linear layers (quantized ones included)."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def apply_method(model: Any, part: ModelPart, gradient_checkpointing: bool) -> Any:
    """Wrap the model for its fine-tuning method (returns it unchanged for full training)."""
    model, config = prepare_adapter(model, part, gradient_checkpointing)
    if config is None:
        return model
    from peft import get_peft_model

    # the adapter's random init, the same in every run and on every rank (FSDP and ZeRO-3 keep each rank's own part)
    torch.manual_seed(part.seed)
    return get_peft_model(model, config)


def prepare_adapter(model: Any, part: ModelPart, gradient_checkpointing: bool) -> tuple[Any, Any]:
    """The model ready for its adapter (a quantized base prepared for k-bit training) and the adapter's
    LoraConfig, checked against the model's layers; (model, None) for full training. DPO hands the config to
    TRL, which wraps the model itself and disables the adapter for the reference."""
    method = part.finetune.method
    if method == "full":
        return model, None
    from peft import LoraConfig, prepare_model_for_kbit_training

    options = dict(part.finetune.lora)
    targets = options.pop("target_modules", None) or DEFAULT_TARGETS.get(model.config.model_type)
    if not targets:
        raise HftrainError(
            f"finetune.lora.target_modules: no default for {model.config.model_type}; name the linear layers to adapt."
        )
    available = linear_names(model)
    unknown = [t for t in ([targets] if isinstance(targets, str) else targets) if t not in available]
    if unknown:
        raise HftrainError(
            f"finetune.lora.target_modules: {', '.join(unknown)} match no linear layer of this model; its linear "
            f"layers are: {', '.join(available)}."
        )
    if method in QUANTIZED:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        _compat.bnb_4bit_trainable_on_cpu(model)
    try:
        return model, LoraConfig(task_type="CAUSAL_LM", target_modules=targets, **options)
    except (TypeError, ValueError) as err:
        raise HftrainError(f"finetune.lora: {err}") from None
