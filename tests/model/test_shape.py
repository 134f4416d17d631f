"""The model's numbers by arithmetic (model/shape.py's of_gpt_neox) are exactly what transformers' own
GPTNeoXForCausalLM is made of, read from its modules on the meta device: every preset, both attention_bias settings,
tied embeddings, an MLP width that is not 4x; and a recipe's measure uses the arithmetic for transformers' GPT-NeoX
and the modules for anything else."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig

import hftrain
from hftrain.model import shape as model_shape
from hftrain.model.config import GPT_NEOX_DEFAULTS
from hftrain.model.part import ModelPart
from hftrain.model.shape import measure_model, of_gpt_neox, of_module
from hftrain.recipe.presets import PRESETS

VARIANTS = {
    **{
        name: {**p.config_fields(), "vocab_size": p.config_fields()["vocab_size"] or 4096}
        for name, p in PRESETS.items()
    },
    "no attention bias": {
        "num_hidden_layers": 3,
        "hidden_size": 96,
        "num_attention_heads": 4,
        "intermediate_size": 200,
        "attention_bias": False,
    },
    "tied embeddings": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 500,
        "tie_word_embeddings": True,
    },
}


def numbers(shape) -> tuple:
    return (
        shape.counts,
        sorted(shape.linears, key=lambda linear: linear.name),
        shape.blocks,
        shape.block_params,
        shape.flops_per_token,
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_arithmetic_is_the_meta_models_layer_by_layer(name):
    fields = dict(VARIANTS[name])
    fields.pop("rotary_pct", None)
    config = GPTNeoXConfig(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert numbers(of_gpt_neox(config, 256)) == numbers(of_module(model, 256))


def recipe_part(model: dict) -> ModelPart:
    return ModelPart.of(hftrain.load_recipe(None, {"model": model, "training": {"max_steps": 10, "output_dir": "x"}}))


@pytest.mark.parametrize(
    "model", [{"preset": "pythia-160m"}, {"preset": "cpu-small", "hidden_size": 96, "intermediate_size": 200}]
)
def test_a_preset_recipe_is_counted_from_its_fields_as_the_model_train_builds(model, monkeypatch):
    """A preset recipe's numbers come from its fields and GPTNeoXConfig's defaults (config_view, no transformers),
    and are those of the model `hftrain train` builds from transformers' config of the same recipe; pythia-160m's
    is Pythia's published size."""
    monkeypatch.setattr(
        model_shape, "meta_model", lambda *a: pytest.fail("transformers' GPT-NeoX is counted, not built")
    )
    part = recipe_part(model)
    shape = measure_model(part)
    assert {k: getattr(GPTNeoXConfig(), k) for k in GPT_NEOX_DEFAULTS} == GPT_NEOX_DEFAULTS
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(shape.config)  # transformers' config, made when asked for
    assert type(shape.config) is GPTNeoXConfig and numbers(shape) == numbers(of_module(built, part.seq_len))
    if model["preset"] == "pythia-160m":
        assert shape.counts["total"] == 162_322_944 and shape.counts["non_embedding"] == 85_056_000  # Pythia's table
        assert len(shape.linears) == 4 * 12 + 1 and shape.blocks == "gpt_neox.layers" and len(shape.block_params) == 12
    json.dumps(shape.counts)  # plain numbers: results.json and `plan` print them


def test_a_checkpoint_with_its_own_modeling_code_is_counted_from_its_modules(monkeypatch, tmp_path):
    """A pretrained config whose auto_map names its own modeling code (trust_remote_code) is not transformers'
    GPT-NeoX: its model is built on the meta device and read."""
    config = GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500)
    config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    assert not model_shape.is_plain_gpt_neox(config) and model_shape.is_plain_gpt_neox(GPTNeoXConfig())
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(
            GPTNeoXConfig(**{k: v for k, v in config.to_dict().items() if k != "auto_map"})
        )
    monkeypatch.setattr(model_shape, "tokenizer_size_estimate", lambda part: (500, False))
    monkeypatch.setattr(model_shape, "config_view", lambda part, size, new: (config, lambda: config))
    monkeypatch.setattr(model_shape, "meta_model", lambda part, c: built)
    part = recipe_part({"from_pretrained": str(tmp_path)})
    assert numbers(measure_model(part)) == numbers(of_module(built, part.seq_len))
