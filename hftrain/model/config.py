"""Model section -> transformers' GPTNeoXConfig (or a pretrained model's own config): the model's shape before any
module exists.

A preset gives the shape, recipe keys override any field, and the vocabulary is sized so that the tokenizer and
the embedding always match. `from_pretrained` reads the checkpoint's config.json. Nothing here imports modeling
code, and a preset's fields (``preset_fields``, ``config_view``) need no transformers at all: `hftrain plan` and
the checks before a launch count the model from them (model/shape.py); model/build.py makes the module from the
config (``build_config``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from hftrain.errors import HftrainError
from hftrain.model.remote_code import allow
from hftrain.recipe.presets import PRESETS
from hftrain.recipe.schema import DROPOUT_FIELDS

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart


def padded_vocab_size(tokenizer_size: int, multiple: int) -> int:
    return int(math.ceil(tokenizer_size / multiple) * multiple)


def resolve_vocab_size(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> int:
    """Embedding rows for a model built from a preset (see ModelSection.vocab_size)."""
    m = part.model
    if m.vocab_size is not None:
        if m.vocab_size < tokenizer_size:
            raise HftrainError(
                f"model.vocab_size: {m.vocab_size} embedding rows cannot hold the tokenizer's {tokenizer_size} tokens. "
                f"Raise model.vocab_size to at least {tokenizer_size}, "
                "or remove it to size the embedding automatically."
            )
        return m.vocab_size
    preset = PRESETS[m.preset]
    if preset.published and not tokenizer_is_new and tokenizer_size <= preset.vocab_size:
        return preset.vocab_size
    return padded_vocab_size(tokenizer_size, m.pad_vocab_multiple)


# GPTNeoXConfig's defaults for the keys no preset sets that the model's size depends on (tests/model/test_shape.py
# holds them to transformers' own)
GPT_NEOX_DEFAULTS = {"model_type": "gpt_neox", "attention_bias": True}


def preset_fields(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> dict[str, Any]:
    """GPTNeoXConfig's fields for a preset recipe (the preset's, then the recipe's keys, the vocabulary sized for
    the tokenizer), checked; the rotary settings still as the preset names them (rotary_pct, rotary_emb_base)."""
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
    return fields


def build_config(
    part: ModelPart,
    tokenizer_size: int,
    tokenizer_is_new: bool,
    eos_token_id: int | None,
    pad_token_id: int | None = None,
) -> Any:
    """transformers' GPTNeoXConfig for a preset recipe."""
    from transformers import GPTNeoXConfig

    fields = preset_fields(part, tokenizer_size, tokenizer_is_new)
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
        attn_implementation=part.model.attn_implementation,
    )


def config_view(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> tuple[Any, Callable[[], Any]]:
    """(what the model's size reads: the config's attributes, how to make transformers' config). A preset's view is
    its fields with GPTNeoXConfig's defaults, transformers not imported; a pretrained checkpoint's is its config."""
    if part.model.from_pretrained:
        config = recipe_config(part, tokenizer_size, tokenizer_is_new)
        return config, lambda: config
    view = SimpleNamespace(**{**GPT_NEOX_DEFAULTS, **preset_fields(part, tokenizer_size, tokenizer_is_new)})
    return view, lambda: build_config(part, tokenizer_size, tokenizer_is_new, eos_token_id=0)


def recipe_config(part: ModelPart, tokenizer_size: int, tokenizer_is_new: bool) -> Any:
    """The config of the model a run of `part` trains, read or built without the model: a pretrained checkpoint's
    own (its weights checked as `hftrain train` checks them), else the preset's with the recipe's keys."""
    m = part.model
    if not m.from_pretrained:
        return build_config(part, tokenizer_size, tokenizer_is_new, eos_token_id=0)
    local_weights(m.from_pretrained)  # `hftrain plan` refuses the weights `hftrain train` would refuse
    from transformers import AutoConfig

    try:
        remote = allow(m.trust_remote_code, "model.trust_remote_code", m.from_pretrained)
        return AutoConfig.from_pretrained(m.from_pretrained, revision=m.revision, trust_remote_code=remote)
    except (OSError, ValueError) as err:
        raise cannot_load(m.from_pretrained, err) from None


def tokenizer_size_estimate(part: ModelPart) -> tuple[int, bool]:
    """Tokenizer size without training one: (size, is a new tokenizer). A tokenizer to train counts as its
    configured vocab_size; a tokenizer.path that does not load gets the tokenizer's own message."""
    tok = part.tokenizer
    if tok.train is not None:
        return tok.train.vocab_size, True
    from hftrain.model.tokenizer import check_model_tokenizer, from_path, gpt2_tokenizer

    if part.model.from_pretrained:  # `hftrain plan` refuses the tokenizer `hftrain train` would refuse
        loaded = from_path(tok) if tok.path is not None else gpt2_tokenizer()
        check_model_tokenizer(part, loaded)
        return len(loaded), False
    if tok.path is not None:
        return len(from_path(tok)), False
    return 50257, False


def check_context(part: ModelPart, config: Any) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and part.seq_len > limit:
        raise HftrainError(
            f"data.seq_len: {part.seq_len} is longer than the model's context "
            f"(max_position_embeddings = {limit}). Lower data.seq_len, or raise model.max_position_embeddings."
        )


def local_weights(name: str) -> None:
    """A local from_pretrained directory's weights are whole (not a git-lfs pointer, not cut short)."""
    from pathlib import Path

    from hftrain.checkpoint.files import CorruptFile, check_weights

    if Path(name).is_dir():
        try:
            check_weights(Path(name))
        except CorruptFile as err:
            raise HftrainError(f"model.from_pretrained: {err}") from None


def cannot_load(name: str, err: Exception) -> HftrainError:
    return HftrainError(
        f"model.from_pretrained: cannot load {name!r} ({str(err).splitlines()[0]}). "
        "Give a model directory with config.json and weights, or a hub id reachable from here."
    )
