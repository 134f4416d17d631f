"""Run length: steps given directly, or derived from a token budget or from epochs over prepared data."""

from __future__ import annotations

import dataclasses
import json

import pytest

import hftrain
from hftrain.checkpoint.layout import RunLayout
from hftrain.data.part import DataPart
from hftrain.data.prepare import PrepareHow, prepare
from hftrain.errors import HftrainError
from hftrain.planning.run_length import RunLengthPart
from hftrain.recipe.load import load_recipe

from ..support.data import make_documents, tiny_recipe, write_jsonl


def recipe(**changes):
    raw = {
        "data": {"seq_len": 32, **changes.pop("data", {})},
        "training": {"per_device_train_batch_size": 4, **changes},
    }
    return load_recipe(None, raw)


@pytest.mark.parametrize("processes, accumulation, expected", [(1, 1, 782), (2, 1, 391), (2, 3, 131)])
def test_a_token_budget_becomes_steps_of_the_global_batch(processes, accumulation, expected):
    r = recipe(data={"train_tokens": 100_000})
    length = RunLengthPart.of(r).build(4 * accumulation * processes, None)  # the global batch
    assert length.max_steps == expected  # ceil(100,000 / (4 x accumulation x processes x 32))
    assert length.max_steps * length.tokens_per_step >= 100_000 > (length.max_steps - 1) * length.tokens_per_step
    assert length.note.startswith("run length: data.train_tokens=100,000 / ")


def test_epochs_need_prepared_data_and_use_its_token_count():
    r = recipe(num_train_epochs=2)
    assert RunLengthPart.of(r).build(4, 64_000).max_steps == 1000  # 2 x 64,000 / 128
    with pytest.raises(HftrainError, match="training.num_train_epochs: epochs need the data's token count"):
        RunLengthPart.of(r).build(4, None)


def test_max_steps_wins_and_says_what_it_overrode():
    r = recipe(max_steps=7, num_train_epochs=2, data={"train_tokens": 10**6})
    length = RunLengthPart.of(r).build(4, 64_000)
    assert length.max_steps == 7 and length.source == "training.max_steps"
    assert length.note == (
        "run length: training.max_steps=7 (data.train_tokens and training.num_train_epochs not used: "
        "training.max_steps wins)"
    )
    r = recipe(num_train_epochs=2, data={"train_tokens": 1280})
    assert RunLengthPart.of(r).build(4, 64_000).max_steps == 10  # tokens before epochs


def test_nothing_given_is_the_max_steps_message():
    r = recipe()
    with pytest.raises(HftrainError, match=r"^training.max_steps: required\..*data.train_tokens"):
        dataclasses.replace(RunLengthPart.of(r), max_steps=-1).build(4, None)


@pytest.mark.slow
def test_a_run_sized_in_tokens_trains_that_many_and_says_so(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(300))
    raw = tiny_recipe(data, tmp_path / "run", save_steps=100)
    del raw["training"]["max_steps"]
    raw["data"]["train_tokens"] = 2500  # 8 x 32 = 256 tokens per step -> 10 steps
    run = hftrain.train(load_recipe(None, raw))
    out = capsys.readouterr().out
    results = json.loads(RunLayout(run.output_dir).results.read_text())
    assert results["step"] == 10 and results["run_length"]["tokens"] == 2560
    assert "run length: data.train_tokens=2,500 / 256 tokens per step = 10 steps" in out.split("final checkpoint:")[1]


@pytest.mark.slow
def test_epochs_over_prepared_data(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(300))
    raw = tiny_recipe(data, tmp_path / "run", save_steps=100)
    raw["tokenizer"] = {"builtin": "gpt2"}
    prepared = prepare(DataPart.of(load_recipe(None, raw)), str(tmp_path / "prepared"), PrepareHow(workers=1))
    raw["data"] = {**raw["data"], "train": {"pretokenized": str(tmp_path / "prepared")}}
    raw["tokenizer"] = {"path": str(tmp_path / "prepared" / "tokenizer")}
    del raw["training"]["max_steps"]
    raw["training"]["num_train_epochs"] = 0.5
    run = hftrain.train(load_recipe(None, raw))
    results = json.loads(RunLayout(run.output_dir).results.read_text())
    assert results["run_length"]["from"] == "training.num_train_epochs"
    trained = sum(f["tokens"] // 32 for f in prepared["files"]) * 32  # whole blocks of seq_len; validation/ is apart
    assert results["step"] == -(-trained // 2 // 256) > 3
