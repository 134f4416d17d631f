"""Model weights in and out of checkpoints: exact loading (the GPT-NeoX head trap), and the final model as one
standard HF directory however the training sharded (FSDP, ZeRO-3) or adapted (LoRA) it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from hftrain.checkpoint.adapter import is_adapter_dir, merge_adapter, save_adapter
from hftrain.checkpoint.files import check_safetensors
from hftrain.checkpoint.layout import ADAPTER_DIR
from hftrain.errors import HftrainError


def load_checkpoint_weights(model: Any, checkpoint: Path) -> None:
    """A checkpoint's trained weights into `model`: a LoRA adapter's into the peft model, else all of them."""
    for file in sorted(checkpoint.glob("*.safetensors")):
        check_safetensors(file)
    if is_adapter_dir(checkpoint):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, safetensors.torch.load_file(str(checkpoint / "adapter_model.safetensors")))
        return
    load_weights_exactly(model, checkpoint)


def load_weights_exactly(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load a checkpoint's safetensors into `model` through transformers' key mapping, strictly.

    transformers 5.x's Trainer loads the raw file with strict=False; for GPT-NeoX the file's `embed_out.weight`
    then misses the model's `lm_head.weight` and training silently goes on with a fresh output head.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise HftrainError(f"{checkpoint}: no model*.safetensors weights; this checkpoint cannot be resumed.")
    transforms = get_model_conversion_mapping(model) or []
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in safetensors.torch.load_file(str(file), device="cpu").items():
            state[rename_source_key(key, renamings, converters)[0]] = tensor
    expected = set(model.state_dict())
    tied = {k for k in expected - set(state) if _is_tied(model, k)}
    missing, unexpected = expected - set(state) - tied, set(state) - expected
    if missing or unexpected:
        raise HftrainError(
            f"{checkpoint}: weights do not match the model (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}). Was it written by a different model recipe?"
        )
    model.load_state_dict(state, strict=not tied)


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return bool(model.config.tie_word_embeddings) and head is not None and key.endswith("lm_head.weight")


def gathered_adapter(trainer: Any) -> dict[str, torch.Tensor] | None:
    """FSDP and ZeRO-3 shard the adapter too: every rank takes part in gathering its full tensors."""
    if trainer.is_fsdp_enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return {
            k: v.detach().clone().contiguous() for k, v in get_model_state_dict(trainer.model, options=options).items()
        }
    if trainer.is_deepspeed_enabled:
        import deepspeed
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        trainable = {
            k: p for k, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad
        }
        with deepspeed.zero.GatheredParameters(list(trainable.values()), modifier_rank=None):
            state = {k: p.detach().clone().cpu() for k, p in trainable.items()}
        unset_hf_deepspeed_config()  # else loading the base to merge would partition it with ZeRO-3 collectives
        return state
    return None


def save_full_model(trainer: Any, directory: Path, base_model: str) -> None:
    """The model as one standard HF directory (safetensors), however the training sharded or adapted it.
    A LoRA run's `base_model` (model.from_pretrained) is what the adapter is merged into."""
    if hasattr(trainer.model, "peft_config"):  # LoRA: the adapter in adapter/, the merged model beside it
        state = gathered_adapter(trainer)
        if trainer.args.should_save:
            adapter = directory / ADAPTER_DIR
            save_adapter(trainer.model, adapter, base_model, state)
            trainer.processing_class.save_pretrained(adapter)
            merge_adapter(adapter, directory, tokenizer_dir=adapter)
        trainer.accelerator.wait_for_everyone()
        return
    if not trainer.is_fsdp_enabled:
        trainer.save_model(str(directory))  # DDP / single: as is; ZeRO-3: gathers the 16-bit weights
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.args.should_save:
        # own, contiguous copies: the gathered tensors' storage is not something safetensors may inspect
        full = {key: tensor.detach().clone().contiguous() for key, tensor in full.items()}
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(directory, state_dict=full)
        trainer.processing_class.save_pretrained(directory)
    trainer.accelerator.wait_for_everyone()


def trained_model(trainer: Any, final_dir: Path) -> Any:
    """The trained model in this process: the Trainer's own, or read back from final_dir when the training
    sharded it over processes (FSDP, ZeRO-3)."""
    if not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        return trainer.model
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained would partition the copy with ZeRO-3 collectives
    return AutoModelForCausalLM.from_pretrained(final_dir)
