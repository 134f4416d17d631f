"""A recipe, an override or the data it names that cannot work: one table, each mistake with its exact message
through the CLI's own entry point in this process (exit 2, no traceback: an exception other than hftrain's one-line
error escapes `main` and fails the case, as a traceback would in a terminal)."""

from __future__ import annotations

import pytest

import hftrain

from ..support.cli import in_process
from .conftest import fill

# (name, the recipe file's whole text or None, argv with the placeholders of conftest.fill, expected message or None:
# exit 2 and no traceback is all that is asked)
RECIPES = [
    (
        "unknown key",
        None,
        ["train", "{recipe}", "training.learnig_rate=1"],
        "training.learnig_rate: unknown key; did you mean training.learning_rate?",
    ),
    (
        "wrong type",
        None,
        ["train", "{recipe}", "training.max_steps=many"],
        "training.max_steps: Input should be a valid integer",
    ),
    (
        "unknown preset",
        None,
        ["train", "{recipe}", "model.preset=pythia-160"],
        "model.preset: unknown preset 'pythia-160'; did you mean pythia-160m?",
    ),
    (
        "token in recipe",
        None,
        ["train", "{recipe}", "training.hub_token=hf_abc"],
        "training.hub_token: tokens never go in a recipe",
    ),
    (
        "two tokenizers",
        None,
        ["train", "{recipe}", "tokenizer.builtin=gpt2"],
        "tokenizer: give only one of builtin, path or train (got builtin, train)",
    ),
    (
        "no max_steps",
        None,
        ["train", "{recipe}", "training.max_steps=-1"],
        "training.max_steps: required. hftrain streams its data",
    ),
    (  # before: a traceback after the model loaded (torch has no flex attention backward on a CPU), exit 1
        "flex attention on a CPU",
        None,
        ["train", "{recipe}", "model.attn_implementation=flex_attention"],
        "model.attn_implementation: flex_attention cannot train on a CPU (torch ",
    ),
    (  # before: trained on, the folder read twice as often as the recipe's weights said
        "the same token folder twice",
        None,
        ["train", "{recipe}", "data.train=[{{pretokenized: {tmp}/tok}}, {{pretokenized: {tmp}/./tok, weight: 2}}]"],
        "data: train[0] and train[1] are the same source ({tmp}/tok): listed twice, it would be read twice as "
        "often. Give it once, with weight: 3 to draw from it that often",
    ),
    (  # refused with the recipe, as a key out of range (before: taken as unset, "required", after the Trainer loaded)
        "zero max_steps",
        None,
        ["train", "{recipe}", "training.max_steps=0"],
        "training.max_steps: 0 steps: must be a positive number of optimizer steps",
    ),
    (
        "missing file",
        None,
        ["train", "{recipe}", "data.train.path={tmp}/nope.jsonl"],
        "data.train[0].path: no file matches '{tmp}/nope.jsonl'",
    ),
    (
        "empty glob",
        None,
        ["train", "{recipe}", "data.train.path={tmp}/*.parquet"],
        "data.train[0].path: no file matches '{tmp}/*.parquet'",
    ),
    ("malformed line", None, ["train", "{recipe}", "data.train.path={bad}"], "{bad}:2: not valid JSON"),
    (
        "missing field",
        None,
        ["train", "{recipe}", "data.train.path={field}"],
        "{field}:1: no string field 'text' (has: body)",
    ),
    (
        "empty corpus",
        None,
        ["train", "{recipe}", "data.train.path={empty}"],
        "data.train[0]: no documents found in {empty}",
    ),
    (
        "seq_len too long",
        None,
        ["train", "{recipe}", "data.seq_len=4096"],
        "data.seq_len: 4096 is longer than the model's context (max_position_embeddings = 512)",
    ),
    (
        "vocab too small",
        None,
        ["train", "{recipe}", "model.vocab_size=64"],
        "model.vocab_size: 64 embedding rows cannot hold the tokenizer's 320 tokens",
    ),
    (
        "bad model path",
        None,
        ["train", "{recipe}", "model.from_pretrained={notdir}", "tokenizer.train=null", "tokenizer.builtin=gpt2"],
        "model.from_pretrained: cannot load '{notdir}'",
    ),
    (
        "bad tokenizer path",
        None,
        ["train", "{recipe}", "tokenizer.path={notdir}", "tokenizer.train=null"],
        "tokenizer.path: cannot load a tokenizer from '{notdir}'",
    ),
    (
        "strategy mismatch",
        None,
        ["train", "{recipe}", "parallelism.strategy=fsdp"],
        "parallelism.strategy: the recipe asks for FSDP, but this process was launched as single",
    ),
    (
        "global batch",
        None,
        ["train", "{recipe}", "parallelism.global_batch_size=12"],
        "parallelism.global_batch_size: 12 sequences cannot be split into micro-batches of 8",
    ),
    ("bad override", None, ["train", "{recipe}", "max_steps"], None),
    (
        "number given as true",
        None,
        ["plan", "{recipe}", "training.max_steps=true"],
        "training.max_steps: true is not a number; give a number here",
    ),
    (
        "duplicate key",
        "model: {preset: cpu-tiny}\ntraining:\n  max_steps: 5\n  max_steps: 50\n",
        ["plan", "{recipe}"],
        "line 4, column 3: not valid YAML (duplicate key 'max_steps' (first given on line 3); keep one of them)",
    ),
    (
        "alias bomb",
        "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, "
        "*b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, "
        "*d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
        ["plan", "{recipe}"],
        "not valid YAML (aliases expand it to more than 100,000 values; write the values out)",
    ),
    (
        "non-UTF-8 recipe",
        b"model: {preset: cpu-tiny}\n# caf\xe9\n",
        ["plan", "{recipe}"],
        "not UTF-8 text (byte 31); save the recipe as UTF-8",
    ),
    (
        "plan: seq_len past the context",
        None,
        ["plan", "{recipe}", "data.seq_len=4096"],
        "data.seq_len: 4096 is longer than the model's context (max_position_embeddings = 512)",
    ),
    (
        "key of a list",
        None,
        ["plan", "{recipe}", "data.train=[{{path: a.jsonl}}]", "data.train.path=b.jsonl"],
        "data.train is a list here, not a section with keys; give it whole (data.train=...)",
    ),
]


@pytest.mark.parametrize("name, text, argv, expected", RECIPES, ids=[c[0] for c in RECIPES])
def test_a_mistake_in_a_recipe_or_its_data_gets_its_message(capsys, work, name, text, argv, expected):
    recipe = work / "r.yaml"
    if text is not None:
        (recipe.write_bytes if isinstance(text, bytes) else recipe.write_text)(text)
    places = fill(work)
    code, printed = in_process(capsys, *(word.format(**places) for word in argv))
    assert code == 2, (code, printed[-2000:])
    assert "Traceback" not in printed
    if expected is not None:
        assert expected.format(**places) in printed, printed[-2000:]


def test_a_whole_value_replaces_and_a_dotted_key_edits(recipe_file):
    """The README's S3 example gave "exactly one of path, dataset, builtin" when data.train={...} was merged."""
    quick = hftrain.load_recipe("recipes/quickstart.yaml", ['data.train={path: "s3://corpus/*.jsonl.gz"}'])
    assert [s.path for s in quick.data.train] == ["s3://corpus/*.jsonl.gz"] and quick.data.train[0].builtin is None
    later = hftrain.load_recipe(
        recipe_file, ["data.train={path: a.jsonl, text_field: body}", "data.train.path=b.jsonl"]
    )
    assert (later.data.train[0].path, later.data.train[0].text_field) == ("b.jsonl", "body")  # the new value, edited
    twice = hftrain.load_recipe(recipe_file, ["training.max_steps=5", "training.max_steps=7"])
    assert twice.training.max_steps == 7  # left to right, the later one wins
    section = hftrain.load_recipe(recipe_file, ["training={max_steps: 9}"])
    assert section.training.max_steps == 9 and section.training.learning_rate == 6e-4  # hftrain's defaults stay below
