"""Streaming from a real local S3 endpoint (moto's server) through the real s3fs/boto clients."""

from __future__ import annotations

import gzip
import io
import json

import pytest
import yaml

import hftrain
from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data
from hftrain.data.stream import DocumentStream
from hftrain.errors import HftrainError
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import ReaderLayout, merge_positions
from hftrain.recipe.load import load_recipe, recipe_to_dict

from ..support.checks import assert_resumed_matches, copy_checkpoint, losses
from ..support.data import make_documents, tiny_recipe
from ..support.s3_proxy import FaultProxy


def jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def upload_shards(s3, bucket: str, docs: list[str], shards: int, suffix: str = ".jsonl.gz") -> list[str]:
    size = -(-len(docs) // shards)
    urls = []
    for i in range(shards):
        body = jsonl(docs[i * size : (i + 1) * size])
        if suffix.endswith(".gz"):
            body = gzip.compress(body)
        urls.append(s3.put(f"{bucket}/corpus/part-{i:03d}{suffix}", body))
    return urls


def read_all(section) -> list[str]:
    plan = plan_data(section, seed=0)
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    return list(stream.documents(stream.fresh_state()))


def section_for(path: str, **source) -> object:
    return load_recipe(None, {"data": {"train": {"path": path, **source}}}).data


def test_every_format_streams_from_s3_with_the_standard_environment(s3):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    bucket, docs = s3.make_bucket(), make_documents(60)
    s3.put(f"{bucket}/a.jsonl", jsonl(docs))
    s3.put(f"{bucket}/b.jsonl.gz", gzip.compress(jsonl(docs)))  # datasets' streaming fails on this one over S3
    s3.put(f"{bucket}/c.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl(docs)))
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=16)
    s3.put(f"{bucket}/d.parquet", buf.getvalue())
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet"):
        assert read_all(section_for(f"s3://{bucket}/{name}")) == docs, name
    upload_shards(s3, bucket, docs, shards=5)
    assert read_all(section_for(f"s3://{bucket}/corpus/*.jsonl.gz")) == docs  # a glob over shards, in order


@pytest.mark.parametrize("long_at_end", [False, True])
def test_readers_take_byte_ranges_of_one_s3_file(s3, long_at_end):
    """Two readers of one plain JSONL object: a byte range each (exact range reads), or, when the second range
    lies inside one long record, the whole object each, keeping alternate records. Either way every record is
    read once and neither reader is left without data."""
    from hftrain.data.stream import Worker

    bucket = s3.make_bucket()
    docs = make_documents(80) + (["long " * 8000] if long_at_end else [])
    s3.put(f"{bucket}/one.jsonl", jsonl(docs))
    plan = plan_data(section_for(f"s3://{bucket}/one.jsonl"), seed=0)
    parts = []
    for r in range(2):
        stream = DocumentStream(plan.train, seed=0, worker=Worker(r, 2), shuffle=False, loop=False)
        texts, doc = [], ""
        for text, end in stream.pieces(stream.fresh_state()):  # a long record comes in pieces
            doc += text
            if end:
                texts.append(doc)
                doc = ""
        parts.append(texts)
    assert all(parts) and sorted(d for p in parts for d in p) == sorted(docs)


def test_recipe_storage_options_override_the_environment(s3_server, monkeypatch):
    for name in list(s3_server.env()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket, docs = s3_server.make_bucket(), make_documents(20)
    s3_server.put(f"{bucket}/x.jsonl", jsonl(docs))
    options = {
        "endpoint_url": s3_server.endpoint_url,
        "key": s3_server.key,
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    recipe = load_recipe(None, {"data": {"train": {"path": f"s3://{bucket}/x.jsonl", "storage_options": options}}})
    assert read_all(recipe.data) == docs
    saved = yaml.safe_dump(recipe_to_dict(recipe))
    assert "secret: '***'" in saved and "testing" not in saved.replace("key: testing", "")
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_transient_faults_lose_and_repeat_nothing(s3_server, s3, monkeypatch):
    """Resets, cut bodies, 500s and throttling mid-stream: retried (clients' and hftrain's own), same documents."""
    bucket, docs = s3.make_bucket(), make_documents(120)
    upload_shards(s3, bucket, docs, shards=8)
    section = section_for(f"s3://{bucket}/corpus/*.jsonl.gz")
    clean = read_all(section)
    schedule = {1: "reset", 2: "midbody", 3: "503", 5: "500", 6: "midbody", 7: "reset"}
    schedule.update({n: "500" for n in range(9, 15)})  # six 500s in a row: more than botocore's 4 retries
    with FaultProxy(s3_server.endpoint_url, schedule=schedule) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint_url)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        faulty = read_all(section)
    assert faulty == clean == docs
    assert len(proxy.faults) == len(schedule)


def test_missing_and_corrupt_shards_are_named(s3):
    bucket, docs = s3.make_bucket(), make_documents(40)
    urls = upload_shards(s3, bucket, docs, shards=4)
    section = section_for(f"s3://{bucket}/corpus/*.jsonl.gz")
    plan = plan_data(section, 0)  # listed now ...
    s3.client().delete_object(Bucket=bucket, Key="corpus/part-001.jsonl.gz")  # ... gone when read
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    with pytest.raises(HftrainError) as info:
        list(stream.documents(stream.fresh_state()))
    assert f"{urls[1]}: is missing" in str(info.value) and "data.on_bad_record=skip" in str(info.value)

    s3.put(urls[1], b"\x1f\x8b\x08\x00 this is not gzip data at all")
    with pytest.raises(HftrainError, match=r"part-001.jsonl.gz: changed since the run listed it"):
        list(DocumentStream(plan.train, seed=0, shuffle=False, loop=False).documents({**stream.fresh_state()}))
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a new run lists the bucket afresh
    with pytest.raises(HftrainError, match=r"part-001.jsonl.gz: is corrupt"):
        read_all(section)
    skipping = load_recipe(
        None, {"data": {"train": {"path": f"s3://{bucket}/corpus/*.jsonl.gz"}, "on_bad_record": "skip"}}
    ).data
    from hftrain.data.sources import BadRecords

    plan = plan_data(skipping, 0)
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False, bad=BadRecords("skip"))
    state = stream.fresh_state()
    got = list(stream.documents(state))
    assert got == docs[:10] + docs[20:] and state["skipped"] == 1


def test_loader_resumes_exactly_on_s3(s3):
    bucket = s3.make_bucket()
    upload_shards(s3, bucket, make_documents(200), shards=6)
    section = load_recipe(
        None, {"data": {"train": {"path": f"s3://{bucket}/corpus/"}, "seq_len": 32, "shuffle_window": 8}}
    ).data
    plan, tok = plan_data(section, 0), gpt2_tokenizer()
    layout = ReaderLayout(readers=2, processes=1, workers=2, window=8)
    first = ResumableLoader(PackedDataset(plan, tok, 0, layout), 4, 2)
    it = iter(first)
    straight = [next(it)["input_ids"] for _ in range(25)]
    mid = ResumableLoader(PackedDataset(plan, tok, 0, layout), 4, 2)
    it = iter(mid)
    for _ in range(11):
        next(it)
    saved = json.loads(json.dumps(mid.state_dict()))
    del it
    resumed = iter(
        ResumableLoader(PackedDataset(plan, tok, 0, layout, merge_positions([saved], layout, 32, "c")), 4, 2)
    )
    assert all((next(resumed)["input_ids"] == b).all() for b in straight[11:])


@pytest.mark.slow
def test_training_from_s3_resumes_exactly(s3, tmp_path):
    bucket = s3.make_bucket()
    upload_shards(s3, bucket, make_documents(400), shards=4)
    raw = tiny_recipe(tmp_path / "unused.jsonl", tmp_path / "straight", max_steps=12, save_steps=6)
    raw["data"]["train"] = {"path": f"s3://{bucket}/corpus/*.jsonl.gz"}
    straight = hftrain.train(load_recipe(None, raw))
    resumed_dir = tmp_path / "resumed"
    copy_checkpoint(tmp_path / "straight", resumed_dir, "checkpoint-6")
    raw["training"]["output_dir"] = str(resumed_dir)
    resumed = hftrain.train(load_recipe(None, raw))
    a, b = losses(straight), losses(resumed)
    assert a[1] - a[12] > 1.0  # it learns from S3 data
    assert_resumed_matches(a, b, range(7, 13))
