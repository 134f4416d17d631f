"""Model section -> transformers' GPTNeoXConfig / GPTNeoXForCausalLM (never a re-implementation).

A preset gives the shape, recipe keys override any field, and the vocabulary is sized so that the tokenizer
and the embedding always match. `from_pretrained` starts a new run from existing weights.

The model's size and FLOPs live here too (``measure_model``): measured once per run on the meta device, they
feed the speed defaults, MFU and `hftrain plan`. Training FLOPs per token follow the PaLM appendix:
6 N + 12 L d T, where N counts the parameters that do matmuls (all but the input embedding, so the output
head is included), L layers, d hidden size, T context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedModel

from hftrain.errors import HftrainError
from hftrain.model.remote_code import allow
from hftrain.parallel.dims import ParallelDims, Strategy
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.recipe.parts import ModelPart
from hftrain.recipe.presets import PRESETS
from hftrain.recipe.schema import DROPOUT_FIELDS


def padded_vocab_size(tokenizer_size: int, multiple: int) -> int:
    return int(math.ceil(tokenizer_size / multiple) * multiple)


def resolve_vocab_size(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> int:
    """Embedding rows for a model built from a preset (see ModelSection.vocab_size)."""
    m = part.model
    if m.vocab_size is not None:
        if m.vocab_size < tokenizer_size:
            raise HftrainError(
                f"model.vocab_size: {m.vocab_size} embedding rows cannot hold the tokenizer's {tokenizer_size} tokens. "
                f"Raise model.vocab_size to at least {tokenizer_size}, or remove it to size the embedding automatically."
            )
        return m.vocab_size
    preset = PRESETS[m.preset]
    if preset.published and not tokenizer_is_new and tokenizer_size <= preset.vocab_size:
        return preset.vocab_size
    return padded_vocab_size(tokenizer_size, m.pad_vocab_multiple)


def build_config(
    part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool, eos_token_id: int | None, pad_token_id: int | None = None
) -> GPTNeoXConfig:
    m = part.model
    fields: dict[str, Any] = PRESETS[m.preset].config_fields()
    overrides = m.architecture_overrides()
    fields.update(overrides)
    fields.update({k: v for k in DROPOUT_FIELDS if (v := getattr(m, k)) is not None})
    if "intermediate_size" not in overrides and "hidden_size" in overrides:
        fields["intermediate_size"] = 4 * fields["hidden_size"]
    fields["vocab_size"] = resolve_vocab_size(part, tokenizer_size, tokenizer_is_new)
    if fields["hidden_size"] % fields["num_attention_heads"]:
        raise HftrainError(
            f"model: hidden_size {fields['hidden_size']} is not divisible by num_attention_heads "
            f"{fields['num_attention_heads']}; pick a head count that divides it."
        )
    rope = {
        "rope_type": "default",
        "rope_theta": fields.pop("rotary_emb_base", None) or 10000.0,
        "partial_rotary_factor": fields.pop("rotary_pct"),
    }
    return GPTNeoXConfig(
        **fields,
        rope_parameters=rope,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        attn_implementation=m.attn_implementation,
    )


def build_model(part: ModelPart, tokenizer: Any, tokenizer_is_new: bool, dims: ParallelDims | None = None) -> PreTrainedModel:
    """The model a run starts from: pretrained weights, or a fresh preset model (seeded by training.seed).
    `dims`: the run's parallel dims (a quantized model is placed per process); None: one process."""
    m = part.model
    if m.from_pretrained:
        model = load_pretrained(part, dims)
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            raise HftrainError(
                f"tokenizer: {len(tokenizer)} tokens but {m.from_pretrained} has only "
                f"{model.get_input_embeddings().num_embeddings} embedding rows. Use the model's own tokenizer "
                "(tokenizer.path set to the same directory)."
            )
    else:
        config = build_config(part, len(tokenizer), tokenizer_is_new, tokenizer.eos_token_id, tokenizer.pad_token_id)
        torch.manual_seed(part.seed)
        model = GPTNeoXForCausalLM(config)
    check_context(part, model.config)
    return model


def load_pretrained(part: ModelPart, dims: ParallelDims | None = None) -> PreTrainedModel:
    m = part.model
    if m.architecture_overrides():
        raise HftrainError(
            f"model: {', '.join(m.architecture_overrides())} cannot change the shape of a from_pretrained model; "
            "remove them, or build from a preset instead."
        )
    from hftrain.model.finetune import quantization_config, quantized_device_map

    quantization = quantization_config(part.finetuning, dims.strategy if dims is not None else Strategy.SINGLE)
    local_weights(m.from_pretrained)
    try:
        return AutoModelForCausalLM.from_pretrained(
            m.from_pretrained,
            revision=m.revision,
            trust_remote_code=allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained),
            attn_implementation=m.attn_implementation,
            # quantized: bf16 keeps the embeddings and head small too (fp32 leftovers otherwise)
            dtype=torch.bfloat16 if quantization is not None else torch.float32,
            quantization_config=quantization,
            device_map=quantized_device_map(part.finetuning, dims),
            **{k: v for k in DROPOUT_FIELDS if (v := getattr(m, k)) is not None},  # config overrides
        )
    except (OSError, ValueError) as err:
        raise _cannot_load(m.from_pretrained, err) from None


def local_weights(name: str) -> None:
    """A local from_pretrained directory's weights are whole (not a git-lfs pointer, not cut short)."""
    from pathlib import Path

    from hftrain.checkpoint.files import CorruptFile, check_weights

    if Path(name).is_dir():
        try:
            check_weights(Path(name))
        except CorruptFile as err:
            raise HftrainError(f"model.from_pretrained: {err}") from None


def _cannot_load(name: str, err: Exception) -> HftrainError:
    return HftrainError(
        f"model.from_pretrained: cannot load {name!r} ({str(err).splitlines()[0]}). "
        "Give a model directory with config.json and weights, or a hub id reachable from here."
    )


def check_context(part: ModelPart, config: Any) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and part.seq_len > limit:
        raise HftrainError(
            f"data.seq_len: {part.seq_len} is longer than the model's context "
            f"(max_position_embeddings = {limit}). Lower data.seq_len, or raise model.max_position_embeddings."
        )


def meta_model(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> PreTrainedModel:
    """The model with no memory allocated (meta device), for sizing and planning."""
    m = part.model
    if m.from_pretrained:
        local_weights(m.from_pretrained)  # `hftrain plan` refuses the weights `hftrain train` would refuse
        try:
            remote = allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained)
            config = AutoConfig.from_pretrained(m.from_pretrained, revision=m.revision, trust_remote_code=remote)
        except (OSError, ValueError) as err:
            raise _cannot_load(m.from_pretrained, err) from None
    else:
        config = build_config(part, tokenizer_size, tokenizer_is_new, eos_token_id=0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, trust_remote_code=allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained)
        )


def parameter_counts(model: PreTrainedModel) -> dict[str, int]:
    """Total, input-embedding, output-head and non-embedding parameters (Pythia's table convention)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_module = model.get_output_embeddings()
    tied = head_module is not None and head_module.weight is model.get_input_embeddings().weight
    head = 0 if head_module is None or tied else head_module.weight.numel()
    return {"total": total, "embedding": embed, "head": head, "non_embedding": total - embed - head}


def flops_per_token(counts: dict[str, int], config: Any, seq_len: int, objective: str = "lm") -> float:
    """6N + 12·L·d·T per trained token (forward a third, backward two thirds), times the objective's factor (under
    DPO the reference's forward on the same token adds a third: 8N + 16·L·d·T)."""
    matmul_params = counts["total"] - counts["embedding"]
    return (6.0 * matmul_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len) * OBJECTIVES[objective].flops_factor


def tokenizer_size_estimate(part: ModelPart) -> tuple[int, bool]:
    """Tokenizer size without training one: (size, is a new tokenizer). A tokenizer to train counts as its
    configured vocab_size; a tokenizer.path that does not load gets the tokenizer's own message."""
    tok = part.tokenizer
    if tok.train is not None:
        return tok.train.vocab_size, True
    from hftrain.model.tokenizer import check_model_tokenizer, from_path, gpt2_tokenizer

    if part.model.from_pretrained:  # `hftrain plan` refuses the tokenizer `hftrain train` would refuse
        loaded = from_path(tok) if tok.path is not None else gpt2_tokenizer()
        check_model_tokenizer(part.tokenizing, loaded)
        return len(loaded), False
    if tok.path is not None:
        return len(from_path(tok)), False
    return 50257, False


@dataclass(frozen=True)
class ModelShape:
    """A recipe's model measured once on the meta device (nothing allocated)."""

    meta: PreTrainedModel
    counts: dict[str, int]
    flops_per_token: float

    @property
    def config(self) -> Any:
        return self.meta.config

    @property
    def matmul_params(self) -> int:
        return self.counts["total"] - self.counts["embedding"]


def measure_model(part: ModelPart) -> ModelShape:
    """Size and training FLOPs per token of the recipe's model: for the speed defaults, MFU and `hftrain plan`."""
    size, is_new = tokenizer_size_estimate(part)
    model = meta_model(part, size, is_new)
    check_context(part, model.config)  # `hftrain plan` refuses what `hftrain train` refuses
    counts = parameter_counts(model)
    return ModelShape(model, counts, flops_per_token(counts, model.config, part.seq_len, part.finetune.objective))
