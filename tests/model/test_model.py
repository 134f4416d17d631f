"""Presets, vocabulary sizing and plan: shapes match the published tables, nothing is allocated."""

from __future__ import annotations

import pytest

from hftrain.errors import HftrainError
from hftrain.model.config import build_config, padded_vocab_size
from hftrain.model.part import ModelPart
from hftrain.model.shape import parameter_counts
from hftrain.planning.estimates import plan
from hftrain.planning.part import PlanPart
from hftrain.recipe.load import load_recipe

# (total, non-embedding) parameters from the Pythia model cards / paper (Biderman et al. 2023) and NeoX-20B.
PUBLISHED = {
    "pythia-14m": (14_067_712, 1_189_888),
    "pythia-31m": (30_494_720, 4_739_072),
    "pythia-70m": (70_426_624, 18_915_328),
    "pythia-160m": (162_322_944, 85_056_000),
    "pythia-410m": (405_334_016, 302_311_424),
    "pythia-1b": (1_011_781_632, 805_736_448),
    "pythia-1.4b": (1_414_647_808, 1_208_602_624),
    "pythia-2.8b": (2_775_208_960, 2_517_652_480),
    "pythia-6.9b": (6_857_302_016, 6_444_163_072),
    "pythia-12b": (11_846_072_320, 11_327_027_200),
    "neox-20b": (20_554_567_680, 19_934_859_264),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(preset):
    info = plan(PlanPart.of(load_recipe(None, {"model": {"preset": preset}})))
    assert (info["parameters"]["total"], info["parameters"]["non_embedding"]) == PUBLISHED[preset]


def test_pythia_architecture_details():
    config = build_config(ModelPart.of(load_recipe(None, {"model": {"preset": "pythia-160m"}})), 50257, False, 0)
    assert config.model_type == "gpt_neox"
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.use_parallel_residual and not config.tie_word_embeddings
    assert (config.vocab_size, config.max_position_embeddings, config.intermediate_size) == (50304, 2048, 3072)


def test_every_architecture_field_is_overridable():
    recipe = load_recipe(
        None,
        {
            "model": {
                "preset": "pythia-70m",
                "rotary_pct": 1.0,
                "use_parallel_residual": False,
                "tie_word_embeddings": True,
                "hidden_size": 256,
                "num_attention_heads": 4,
                "rotary_emb_base": 500000.0,
            }
        },
    )
    config = build_config(ModelPart.of(recipe), 50257, False, 0)
    assert config.rope_parameters["partial_rotary_factor"] == 1.0 and config.rope_parameters["rope_theta"] == 500000.0
    assert not config.use_parallel_residual and config.tie_word_embeddings
    assert config.hidden_size == 256 and config.intermediate_size == 1024  # MLP width follows hidden unless given
    counts = plan(PlanPart.of(recipe))["parameters"]
    assert counts["head"] == 0  # tied: the output head shares the embedding


def test_new_tokenizer_vocab_is_padded_to_the_multiple():
    recipe = load_recipe(None, {"model": {"preset": "pythia-70m"}})
    # a trained tokenizer: padded, not 50304
    assert build_config(ModelPart.of(recipe), 4000, True, 0).vocab_size == 4096
    assert build_config(ModelPart.of(recipe), 50257, False, 0).vocab_size == 50304  # the published size when it fits
    # a bigger tokenizer: padded, never cut
    assert build_config(ModelPart.of(recipe), 60000, False, 0).vocab_size == 60032
    assert padded_vocab_size(129, 64) == 192


@pytest.mark.parametrize(
    "model, message",
    [
        ({"preset": "pyhtia-70m"}, "model.preset: unknown preset 'pyhtia-70m'; did you mean pythia-70m?"),
        (
            {"preset": "pythia-70m", "num_attention_heads": 7},
            "hidden_size 512 is not divisible by num_attention_heads 7",
        ),
    ],
)
def test_bad_model_sections(model, message):
    with pytest.raises(HftrainError) as info:
        build_config(ModelPart.of(load_recipe(None, {"model": model})), 50257, False, 0)
    assert message in str(info.value)


def test_plan_reports_flops_and_memory():
    info = plan(PlanPart.of(load_recipe(None, {"model": {"preset": "pythia-160m"}, "data": {"seq_len": 2048}})))
    n = info["parameters"]["total"] - info["parameters"]["embedding"]
    assert info["train_flops_per_token"] == 6 * n + 12 * 12 * 768 * 2048
    assert info["memory_bytes"]["fp32"]["weights"] == 4 * 162_322_944
    assert info["memory_bytes"]["bf16"]["optimizer"] == 8 * 162_322_944


def test_parameter_counts_of_a_real_model():
    import torch
    from transformers import GPTNeoXForCausalLM

    recipe = load_recipe(None, {"model": {"preset": "cpu-tiny"}})
    model = GPTNeoXForCausalLM(build_config(ModelPart.of(recipe), 300, True, 0))
    counts = parameter_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == 384 * 64 and isinstance(model.lm_head, torch.nn.Linear)


def test_dropout_applies_to_presets_and_to_pretrained_models_alike(pretrained_run):
    """Dropout is training behaviour, not shape: a fine-tuning recipe (and `hftrain parity`) may set it."""
    from hftrain.model.build import load_pretrained

    preset = load_recipe(None, {"model": {"preset": "pythia-70m", "hidden_dropout": 0.1, "attention_dropout": 0.2}})
    config = build_config(ModelPart.of(preset), 50257, False, 0)
    assert (config.hidden_dropout, config.attention_dropout) == (0.1, 0.2)
    recipe = load_recipe(None, {"model": {"from_pretrained": str(pretrained_run.final_dir), "hidden_dropout": 0.1}})
    model = load_pretrained(ModelPart.of(recipe))
    assert model.config.hidden_dropout == 0.1 and model.config.attention_dropout == 0.0
    with pytest.raises(HftrainError, match="hidden_size cannot change the shape of a from_pretrained model"):
        load_pretrained(
            ModelPart.of(
                load_recipe(None, {"model": {"from_pretrained": str(pretrained_run.final_dir), "hidden_size": 32}})
            )
        )


def test_the_end_of_run_sample_takes_its_temperature_from_the_monitor_section(pretrained_run):
    """monitor.sample_temperature (issue 61's worked example: a key of a section held whole reaches its component,
    model/generation.py, through the section alone): 0 is greedy, the same text whatever the seed; the default
    0.8 samples (three seeds, three texts here)."""
    import hftrain
    from hftrain.model.generation import end_of_run_sample, sample

    model, tokenizer = pretrained_run.model, pretrained_run.trainer.processing_class
    monitor = hftrain.load_recipe(None, {"monitor": {"sample_temperature": 0, "sample_max_new_tokens": 12}}).monitor
    greedy = {sample(model, tokenizer, "The ", 12, seed, temperature=0.0) for seed in (0, 1, 2)}
    sampled = {sample(model, tokenizer, "The ", 12, seed) for seed in (0, 1, 2)}
    assert len(greedy) == 1 and len(sampled) == 3, (greedy, sampled)
    assert end_of_run_sample(model, tokenizer, monitor) in greedy  # what the run shows, from its section


class _Tokenizer:
    """What building a model reads of its tokenizer."""

    eos_token_id, pad_token_id = 0, 0

    def __len__(self) -> int:
        return 300


def _built(seed: int = 0, **model):
    from hftrain.model.build import build_model

    recipe = load_recipe(None, {"model": {"preset": "cpu-tiny", **model}, "training": {"seed": seed}})
    return build_model(ModelPart.of(recipe), _Tokenizer(), True)


def test_gpt_neox_init_draws_each_layer_as_pythia_was_drawn():
    """model.init_method small_init and output_layer_init_method wang_init (Pythia's configs; issue 61's worked
    example of a new key: its section and its component, model/build.py with model/init_methods.py): each layer
    role's spread is gpt-neox's formula, biases zero, LayerNorms one and zero; the same weights whatever the global
    RNG drew before; the default stays transformers' N(0, 0.02), so the check fails against a silent fallback."""
    import math

    import torch

    pythia = {"init_method": "small_init", "output_layer_init_method": "wang_init", "tie_word_embeddings": False}
    model = _built(**pythia)
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    small, wang = math.sqrt(2 / (5 * hidden)), 2 / layers / math.sqrt(hidden)
    expected = {"query_key_value": small, "dense_h_to_4h": small, "attention.dense": wang, "dense_4h_to_h": wang}
    weights = dict(model.named_parameters())
    drawn = {name: [p for n, p in weights.items() if name in n and n.endswith("weight")] for name in expected}
    drawn |= {"embedding": [model.get_input_embeddings().weight], "head": [model.get_output_embeddings().weight]}
    for name, std in {**expected, "embedding": small, "head": small}.items():
        assert drawn[name], name
        spread = [p.std().item() for p in drawn[name]]
        assert all(abs(s / std - 1) < 0.05 for s in spread), (name, spread, std)
    assert all(p.abs().max() == 0 for n, p in weights.items() if n.endswith("bias") and "layernorm" not in n)
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in weights.items() if "layernorm.weight" in n)
    from transformers import GPTNeoXForCausalLM

    from hftrain.model import init_methods

    torch.manual_seed(1234)  # another model, the global RNG in another state: the draws are training.seed's alone
    again = GPTNeoXForCausalLM(model.config)
    init_methods.apply(again, "small_init", "wang_init", seed=0)
    redrawn = [n for n in weights if n.endswith("weight") and "layernorm" not in n]
    assert all(torch.equal(weights[n], dict(again.named_parameters())[n]) for n in redrawn)
    assert not torch.equal(
        weights["gpt_neox.embed_in.weight"], dict(_built(1, **pythia).named_parameters())["gpt_neox.embed_in.weight"]
    )  # another training.seed, other weights
    plain = dict(_built().named_parameters())
    dense = [p for n, p in plain.items() if "attention.dense.weight" in n]
    assert all(abs(p.std().item() / 0.02 - 1) < 0.05 for p in dense) and abs(wang / 0.02 - 1) > 0.5


def test_gpt_neox_init_is_refused_for_pretrained_weights():
    with pytest.raises(HftrainError) as info:
        load_recipe(None, {"model": {"from_pretrained": "some/model", "output_layer_init_method": "wang_init"}})
    assert (
        "model: output_layer_init_method draws the weights of a model built from scratch, but from_pretrained loads "
        "its weights; remove them, or build from model.preset"
    ) in str(info.value)
