"""Recipe loading: precedence, typed overrides, and one clear message per bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hftrain.errors import HftrainError
from hftrain.recipe.load import apply_overrides, fingerprint, load_recipe, recipe_to_dict

from ..support.cli import ROOT

RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(HftrainError) as info:
        load_recipe(*args, **kwargs)
    return str(info.value)


def test_unknown_key_names_nearest_valid_key(tmp_path):
    path = write(tmp_path, "training:\n  learnig_rate: 3e-4\n  max_steps: 5\n")
    assert "training.learnig_rate: unknown key; did you mean training.learning_rate?" in error_of(path)


def test_unknown_section_and_nested_source_key(tmp_path):
    path = write(tmp_path, "modle: {preset: pythia-14m}\ndata:\n  train: [{pth: a.txt}]\n")
    message = error_of(path)
    assert "modle: unknown key; did you mean model?" in message
    assert "data.train[0].pth: unknown key; did you mean data.train[0].path?" in message


def test_every_problem_reported_at_once_with_what_was_given(tmp_path):
    path = write(tmp_path, "training: {max_steps: lots, learnig_rate: 1}\ndata: {seq_len: -4}\n")
    message = error_of(path)
    assert "3 problem(s)" in message
    assert "training.max_steps: Input should be a valid integer" in message and "(got 'lots')" in message
    assert "data.seq_len: Input should be greater than 1 (got -4)" in message
    assert "Traceback" not in message


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "the recipe is empty"),
        ("# only a comment\n", "the recipe is empty"),
        (
            "- a\n- b\n",
            "a recipe must be a mapping of sections (model, tokenizer, data, training, monitor), got a list",
        ),
        ("just words", "a recipe must be a mapping of sections"),
        ("training:\n  max_steps: [1,\n", "line 3"),
    ],
)
def test_file_level_problems(tmp_path, text, expected):
    path = write(tmp_path, text)
    message = error_of(path)
    assert str(path) in message and expected in message


def test_missing_recipe_file_is_named(tmp_path):
    assert "nope.yaml: recipe file not found" in error_of(tmp_path / "nope.yaml")


def test_precedence_defaults_then_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "training:\n  learning_rate: 1e-3\n  max_steps: 7\n  warmup_steps: 2\n")
    recipe = load_recipe(path, ["training.learning_rate=3e-4"])
    assert recipe.training.learning_rate == pytest.approx(3e-4)  # CLI beats YAML
    assert recipe.training.max_steps == 7  # YAML kept where the CLI is silent
    assert recipe.training.warmup_steps == 2  # YAML beats hftrain's default
    assert recipe.training.weight_decay == pytest.approx(0.1)  # hftrain default where both are silent
    assert recipe.training.output_dir == "runs/r"  # default output_dir follows the recipe's name


def test_yaml_reads_exponent_floats():
    recipe = load_recipe(None, {"training": {"learning_rate": "3e-4"}})
    assert isinstance(recipe.training.learning_rate, float)


def test_overrides_are_typed():
    tree = apply_overrides({}, ["a.i=5", "a.f=3e-4", "a.b=true", "a.l=[1, 2]", "a.n=null", "a.s=hello", "a.e="])
    assert tree == {"a": {"i": 5, "f": 3e-4, "b": True, "l": [1, 2], "n": None, "s": "hello", "e": ""}}


@pytest.mark.parametrize("bad", ["max_steps", "=5", "training..x=1"])
def test_malformed_override(bad):
    with pytest.raises(HftrainError, match="write it as section.key=value"):
        apply_overrides({}, [bad])


def test_override_unknown_key_is_caught():
    assert "training.max_stpes: unknown key; did you mean training.max_steps?" in error_of(
        None, ["training.max_stpes=3"]
    )


def test_notebook_keyword_overrides(tmp_path):
    path = write(tmp_path, "training: {max_steps: 9}\n")
    assert load_recipe(path, training={"max_steps": 50}).training.max_steps == 50


def test_tokenizer_kinds_are_exclusive():
    assert "give only one of builtin, path or train (got builtin, path)" in error_of(
        None, {"tokenizer": {"builtin": "gpt2", "path": "x"}}
    )
    assert load_recipe(None, {"tokenizer": {"path": "x"}}).tokenizer.builtin is None


def test_source_needs_exactly_one_origin():
    assert "give exactly one of path, dataset, builtin, pretokenized or megatron (got none)" in error_of(
        None, {"data": {"train": {"weight": 2}}}
    )


def test_saved_recipe_has_no_secrets():
    options = {"key": "AKIAEXAMPLE", "secret": "s3cr3tVALUE", "client_kwargs": {"aws_secret_access_key": "another0ne"}}
    recipe = load_recipe(None, {"data": {"train": {"path": "s3://b/x.jsonl", "storage_options": options}}})
    dumped = yaml.safe_dump(recipe_to_dict(recipe))
    assert "s3cr3tVALUE" not in dumped and "another0ne" not in dumped and "AKIAEXAMPLE" not in dumped
    assert dumped.count("'***'") == 3  # key, secret and the client's key: storage options that are not settings
    assert "sample_max_new_tokens: 48" in dumped  # a key that merely contains "token" is not a secret


def test_tokens_are_refused_in_recipes():
    message = error_of(None, {"training": {"hub_token": "hf_SECRET123"}})
    assert "training.hub_token: tokens never go in a recipe" in message and "hf_SECRET123" not in message


def test_fingerprint_ignores_training_settings():
    a = load_recipe(None, {"training": {"max_steps": 3}})
    b = load_recipe(None, {"training": {"max_steps": 300, "learning_rate": 1e-5}})
    c = load_recipe(None, {"training": {"max_steps": 3}, "model": {"hidden_size": 256}})
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a)["model"] != fingerprint(c)["model"]


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT)) for p in RECIPES])
def test_every_shipped_recipe_validates_and_plans(path, request):
    from hftrain.planning.estimates import plan
    from hftrain.planning.part import PlanPart

    recipe = load_recipe(path)
    if recipe.model.from_pretrained and not (ROOT / recipe.model.from_pretrained).exists():
        # the fine-tuning recipes (and the Pythia continuation) start from the quickstart's model
        base = str(request.getfixturevalue("pretrained_run").final_dir)
        shorter = ["data.seq_len=256"] if recipe.data.seq_len > 256 else []  # the quickstart model's context
        recipe = load_recipe(path, [f"model.from_pretrained={base}", f"tokenizer.path={base}", *shorter])
    for source in recipe.data.train:
        assert source.path is None or "://" in source.path or list(ROOT.glob(source.path)), source.path
    info = plan(PlanPart.of(recipe))
    assert info["parameters"]["total"] > 0
    assert recipe.training.max_steps and recipe.training.max_steps > 0


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from(
    ["model", "tokenizer", "data", "training", "monitor", "preset", "train", "path", "max_steps", "seq_len", "x"]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        yaml_values,
        st.dictionaries(keys, st.one_of(yaml_values, st.dictionaries(keys, yaml_values, max_size=3)), max_size=4),
    )
)
def test_random_yaml_gives_only_validation_errors(tmp_path, data):
    path = write(tmp_path, yaml.safe_dump(data), "random.yaml")
    try:
        load_recipe(path)
    except HftrainError as err:
        assert str(err).strip()
