"""The model a run trains: transformers' GPTNeoXForCausalLM of the recipe's config (model/config.py), or a
pretrained checkpoint's weights (never a re-implementation). Its size and FLOPs, known before it exists, are
model/shape.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM, PreTrainedModel

from hftrain.errors import HftrainError
from hftrain.model import init_methods
from hftrain.model.config import build_config, cannot_load, check_context, local_weights
from hftrain.model.remote_code import allow
from hftrain.parallel.dims import ParallelDims, Strategy
from hftrain.recipe.schema import DROPOUT_FIELDS

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart


def build_model(
    part: ModelPart, tokenizer: Any, tokenizer_is_new: bool, dims: ParallelDims | None = None
) -> PreTrainedModel:
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
        init_methods.apply(model, m.init_method, m.output_layer_init_method, part.seed)  # gpt-neox's, if asked
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

    quantization = quantization_config(part, dims.strategy if dims is not None else Strategy.SINGLE)
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
            device_map=quantized_device_map(part, dims),
            **{k: v for k in DROPOUT_FIELDS if (v := getattr(m, k)) is not None},  # config overrides
        )
    except (OSError, ValueError) as err:
        raise cannot_load(m.from_pretrained, err) from None
