"""Checkpoints on disk: which ones are complete, which run owns a directory, and loading weights exactly.

A checkpoint is written into ``output_dir/.staging/checkpoint-N`` and renamed into place only once the
Trainer's files, the data position and the resolved recipe are all there, then marked complete. A kill
during a save leaves a staging directory that the next start removes; ``checkpoint-N`` directories without
the marker (copied by hand, half-deleted) are never resumed from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from .errors import HftrainError
from .recipe import fingerprint, save_recipe
from .recipe_schema import Recipe

COMPLETE_MARKER = "hftrain_complete.json"
RECIPE_FILE = "hftrain_recipe.yaml"
RUN_FILE = "hftrain_run.json"
STAGING = ".staging"
FINAL = "final"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def data_state_file(rank: int) -> str:
    return f"hftrain_data_state-rank{rank}.json"


# --------------------------------------------------------------------------------------- discovery
def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest step first."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT.match(child.name)
        if match and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def clean_partial(output_dir: Path) -> list[str]:
    """Remove what interrupted saves left behind; returns what was removed (for the log)."""
    removed = []
    staging = output_dir / STAGING
    if staging.is_dir():
        removed += [str(p) for p in staging.iterdir()]
        shutil.rmtree(staging, ignore_errors=True)
    return removed


def rotate(output_dir: Path, keep: int | None) -> None:
    """Keep the newest `keep` complete checkpoints (None or <= 0: keep all)."""
    if not keep or keep <= 0:
        return
    for old in complete_checkpoints(output_dir)[:-keep]:
        (old / COMPLETE_MARKER).unlink(missing_ok=True)  # never leave a half-deleted "complete" checkpoint
        shutil.rmtree(old, ignore_errors=True)


def publish(staged: Path, final: Path, info: dict[str, Any]) -> None:
    """Mark a fully written staging directory complete and move it into place atomically."""
    (staged / COMPLETE_MARKER).write_text(json.dumps(info, indent=2), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    try:
        staged.parent.rmdir()  # only if no other save is in progress
    except OSError:
        pass


def write_extras(directory: Path, recipe: Recipe) -> None:
    """What makes a checkpoint explain itself: the resolved recipe, secrets removed."""
    save_recipe(recipe, directory / RECIPE_FILE)


def gathered_adapter(trainer: Any) -> dict[str, torch.Tensor] | None:
    """FSDP and ZeRO-3 shard the adapter too: every rank takes part in gathering its full tensors."""
    if trainer.is_fsdp_enabled:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return {k: v.detach().clone().contiguous() for k, v in get_model_state_dict(trainer.model, options=options).items()}
    if trainer.is_deepspeed_enabled:
        import deepspeed
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        trainable = {k: p for k, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}
        with deepspeed.zero.GatheredParameters(list(trainable.values()), modifier_rank=None):
            state = {k: p.detach().clone().cpu() for k, p in trainable.items()}
        unset_hf_deepspeed_config()  # else loading the base to merge would partition it with ZeRO-3 collectives
        return state
    return None


def save_full_model(trainer: Any, directory: Path) -> None:
    """The model as one standard HF directory (safetensors), however the training sharded or adapted it."""
    if hasattr(trainer.model, "peft_config"):  # LoRA: the adapter in adapter/, the merged model beside it
        from .finetune import merge_adapter, save_adapter

        state = gathered_adapter(trainer)
        if trainer.args.should_save:
            adapter = directory / "adapter"
            save_adapter(trainer.model, adapter, trainer.recipe.model.from_pretrained or "", state)
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


# ----------------------------------------------------------------------------------- run identity
def claim_output_dir(output_dir: Path, recipe: Recipe, is_main: bool) -> None:
    """Refuse an output_dir that holds a different run (model, tokenizer or data); record ours otherwise."""
    run_file = output_dir / RUN_FILE
    mine = fingerprint(recipe)
    if run_file.is_file():
        theirs = json.loads(run_file.read_text(encoding="utf-8")).get("fingerprint", {})
        differ = [part for part in ("model", "tokenizer", "data") if theirs.get(part) != mine[part]]
        has_work = bool(complete_checkpoints(output_dir)) or (output_dir / FINAL).is_dir()
        if differ and has_work:
            raise HftrainError(
                f"training.output_dir: {output_dir} holds a run whose {' and '.join(differ)} differ from this recipe's. "
                f"Continuing it would mix two runs. Set training.output_dir to a new directory, or delete {output_dir} "
                "to start fresh. (Changing training settings such as max_steps or learning_rate continues a run.)"
            )
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        partial = run_file.with_suffix(".tmp")
        partial.write_text(json.dumps({"fingerprint": mine}, indent=2), encoding="utf-8")
        os.replace(partial, run_file)  # other processes never read a half-written file


# ------------------------------------------------------------------------------------ exact loading
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
            f"{checkpoint}: weights do not match the model (missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}). "
            "Was it written by a different model recipe?"
        )
    model.load_state_dict(state, strict=not tied)


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    head = getattr(model, "get_output_embeddings", lambda: None)()
    return bool(model.config.tie_word_embeddings) and head is not None and key.endswith("lm_head.weight")
