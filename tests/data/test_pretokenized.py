"""Pre-tokenized shards: prepare once (local and S3), train from them, refuse a mismatched tokenizer or seq_len."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hftrain
from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data, train_blocks, train_documents
from hftrain.data.prepare import prepare
from hftrain.data.stream import BlockStream, Worker
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import ReaderLayout, default_window, merge_positions
from hftrain.recipe.load import load_recipe
from hftrain.recipe.parts import DataPrepPart

from ..support.checks import losses
from ..support.data import make_documents, tiny_recipe, write_jsonl


def gpt2_recipe(data, out, **training):
    raw = tiny_recipe(data, out, **training)
    raw["tokenizer"] = {"builtin": "gpt2"}
    return raw


@pytest.fixture
def prepared(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(500))
    raw = gpt2_recipe(data, tmp_path / "unused")
    manifest = prepare(DataPrepPart.of(load_recipe(None, raw)), str(tmp_path / "prep"), shard_mb=0.004)
    return tmp_path, raw, manifest


def test_prepare_writes_shards_and_manifest_with_the_same_blocks(prepared):
    tmp_path, raw, manifest = prepared
    assert manifest["dtype"] == "<u2" and manifest["seq_len"] == 32 and len(manifest["shards"]) > 3
    assert manifest["tokens"] == manifest["blocks"] * 32 == sum(s["blocks"] for s in manifest["shards"]) * 32
    assert (tmp_path / "prep" / "tokenizer" / "tokenizer.json").is_file()
    # the shards hold exactly the blocks the on-the-fly pipeline makes (unshuffled order)
    plan = plan_data(load_recipe(None, raw).data, 0)
    docs = train_documents(plan, loop=False)
    docs.shuffle = False
    stream = BlockStream(docs, gpt2_tokenizer(), 32, window=1)
    live = [b for b, _ in stream.blocks(stream.fresh_state())]
    stored = np.concatenate([np.fromfile(tmp_path / "prep" / s["name"], dtype="<u2") for s in manifest["shards"]])
    assert (np.concatenate(live) == stored).all()


@pytest.mark.slow
def test_training_from_shards_learns_and_resumes_exactly(prepared):
    tmp_path, raw, _ = prepared
    raw = {
        **raw,
        "data": {"train": {"pretokenized": str(tmp_path / "prep")}, "seq_len": 32, "eval_blocks": 8},
        "tokenizer": {"path": str(tmp_path / "prep" / "tokenizer")},
    }
    raw["training"] = {**raw["training"], "output_dir": str(tmp_path / "a"), "max_steps": 10, "save_steps": 5}
    run = hftrain.train(load_recipe(None, raw))
    per_step = losses(run)
    assert per_step[1] - per_step[10] > 1.0
    plan = plan_data(load_recipe(None, raw).data, 0)
    layout = ReaderLayout(readers=2, processes=1, workers=2, window=default_window(2, 32))
    straight = iter(ResumableLoader(PackedDataset(plan, None, 0, layout), 4, 2))
    expected = [next(straight)["input_ids"] for _ in range(20)]
    first = ResumableLoader(PackedDataset(plan, None, 0, layout), 4, 2)
    it = iter(first)
    for _ in range(7):
        next(it)
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = iter(ResumableLoader(PackedDataset(plan, None, 0, layout, merge_positions([saved], layout, 32, "c")), 4, 2))
    assert all((next(resumed)["input_ids"] == e).all() for e in expected[7:])


def test_mismatched_seq_len_and_tokenizer_are_refused(prepared, tmp_path):
    _, raw, _ = prepared
    base = {**raw, "data": {"train": {"pretokenized": str(tmp_path / "prep")}, "seq_len": 64}}
    base["tokenizer"] = {"path": str(tmp_path / "prep" / "tokenizer")}
    with pytest.raises(HftrainError, match="data.seq_len: 64, but the shards in .* hold blocks of 32 tokens"):
        hftrain.train(load_recipe(None, base))
    other = {**base, "data": {**base["data"], "seq_len": 32}, "tokenizer": {"train": {"vocab_size": 300}}}
    with pytest.raises(HftrainError, match="the training data is pre-tokenized, so there is no text to learn from"):
        hftrain.train(load_recipe(None, other))


@pytest.mark.slow
def test_prepare_to_s3_and_train_from_it(s3, tmp_path):
    bucket = s3.make_bucket()
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(300))
    out = f"s3://{bucket}/tokenized/tiny-32"
    manifest = prepare(DataPrepPart.of(load_recipe(None, gpt2_recipe(data, tmp_path / "u"))), out, shard_mb=0.004)
    raw = gpt2_recipe(data, tmp_path / "run", max_steps=4, save_steps=4)
    raw["data"] = {"train": {"pretokenized": out}, "seq_len": 32, "eval_blocks": 4}
    run = hftrain.train(load_recipe(None, raw))
    assert run.trainer.state.global_step == 4 and manifest["blocks"] > 100
    second = manifest["shards"][1]["name"]
    s3.client().delete_object(Bucket=bucket, Key=f"tokenized/tiny-32/{second}")
    plan = plan_data(load_recipe(None, raw).data, 0)
    stream = train_blocks(plan, None, Worker(), 256)
    with pytest.raises(HftrainError, match=f"{second}: shard listed in the manifest is missing"):
        for _ in zip(range(100_000), stream.blocks(stream.fresh_state())):  # an endless stream: bounded
            pass


@pytest.mark.slow
def test_prepare_on_two_processes_writes_the_same_shards_and_shows_progress(tmp_path, monkeypatch, capsys):
    from hftrain.data import prepare as prepare_module

    monkeypatch.setattr(prepare_module.Progress, "EVERY_S", 0.0)
    docs = make_documents(400)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    (tmp_path / "book.txt").write_text(" ".join(docs) * 20, encoding="utf-8")  # a long document too
    raw = gpt2_recipe(data, tmp_path / "unused")
    raw["data"]["train"] = [{"path": str(data)}, {"path": str(tmp_path / "book.txt")}]
    raw["data"]["validation"] = {"path": str(data)}
    part = DataPrepPart.of(load_recipe(None, raw))
    one = prepare(part, str(tmp_path / "one"), shard_mb=0.05, processes=1)
    two = prepare(part, str(tmp_path / "two"), shard_mb=0.05, processes=2)
    assert one["tokens"] > 100_000 and len(one["shards"]) > 3
    assert one["shards"] == two["shards"] and one["tokens"] == two["tokens"]
    for shard in one["shards"]:
        assert (tmp_path / "one" / shard["name"]).read_bytes() == (tmp_path / "two" / shard["name"]).read_bytes()
    err = capsys.readouterr().err
    assert "prepare: " in err and " tokens/s, " in err and "% of the data read, ETA " in err
