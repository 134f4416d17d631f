"""gs:// sources through the real gcsfs client, talking HTTP to a local GCS JSON API endpoint (tests/support/gcs.py)."""

from __future__ import annotations

import gzip
import io
import json
import sys

import pytest
import yaml

import hftrain
from hftrain.data.loader import plan_data
from hftrain.data.sources import BadRecords, read_shard
from hftrain.data.stream import DocumentStream
from hftrain.errors import HftrainError
from hftrain.recipe.load import load_recipe, recipe_to_dict

from ..support.checks import losses
from ..support.data import make_documents, tiny_recipe


def jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def read_all(path: str, **source) -> list[str]:
    plan = plan_data(load_recipe(None, {"data": {"train": {"path": path, **source}}}).data, seed=0)
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    return list(stream.documents(stream.fresh_state()))


def put_shards(gcs, prefix: str, docs: list[str], shards: int) -> list[str]:
    size = -(-len(docs) // shards)
    return [
        gcs.put(f"{prefix}/part-{i:03d}.jsonl.gz", gzip.compress(jsonl(docs[i * size : (i + 1) * size])))
        for i in range(shards)
    ]


def test_every_format_streams_from_gcs_like_local_files(gcs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = make_documents(60)
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=16)
    bodies = {
        "a.jsonl": jsonl(docs),
        "b.jsonl.gz": gzip.compress(jsonl(docs)),
        "c.jsonl.zst": zstandard.ZstdCompressor().compress(jsonl(docs)),
        "d.parquet": buf.getvalue(),
        **{f"txt/{i}.txt": d.encode() for i, d in enumerate(docs[:4])},
    }
    for name, body in bodies.items():
        gcs.put(f"gs://bkt/{name}", body)
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(body)
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "txt/*.txt", "txt/"):
        assert read_all(f"gs://bkt/{name}") == read_all(str(tmp_path / "local" / name)), name
    assert read_all("gs://bkt/d.parquet") == docs and read_all("gs://bkt/txt/") == docs[:4]

    urls = put_shards(gcs, "gs://bkt/corpus", docs, shards=7)
    assert read_all("gs://bkt/corpus/*.jsonl.gz") == docs  # a glob over shards, in order, across listing pages
    assert any("pageToken=" in r for r in gcs.requests)  # the listing really was paginated over HTTP

    # A resumed plain-JSONL shard starts at its byte offset: a ranged download, not a re-read from the start.
    source = load_recipe(None, {"data": {"train": {"path": "gs://bkt/a.jsonl"}}}).data.train[0]
    records = list(read_shard(source, "gs://bkt/a.jsonl", (0, 0), BadRecords("fail")))
    gcs.requests.clear()
    resumed = [r.text for r in read_shard(source, "gs://bkt/a.jsonl", records[39].pos, BadRecords("fail"))]
    assert resumed == docs[40:]
    assert any("alt=media" in r and f"Range: bytes={records[39].pos[0]}-" in r for r in gcs.requests), gcs.requests
    assert len(urls) == 7


def test_recipe_storage_options_reach_gcs_and_are_redacted(gcs, monkeypatch):
    """endpoint_url + token: anon from the recipe, with no Google environment at all."""
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    docs = make_documents(20)
    gcs.put("gs://open/x.jsonl", jsonl(docs))
    options = {"endpoint_url": gcs.endpoint_url, "token": "anon"}
    assert read_all("gs://open/x.jsonl", storage_options=options) == docs
    service_account = {
        "type": "service_account",
        "client_email": "me@p.iam.gserviceaccount.com",
        "private_key_id": "abc123",
        "private_key": "-----BEGIN PRIVATE KEY-----xyz",
    }
    recipe = load_recipe(
        None, {"data": {"train": {"path": "gs://open/x.jsonl", "storage_options": {"token": service_account}}}}
    )
    saved = yaml.safe_dump(recipe_to_dict(recipe))
    assert "token: '***'" in saved
    assert not any(v in saved for v in ("abc123", "PRIVATE KEY", "me@p.iam"))


def test_training_from_a_gcs_glob_learns(gcs, tmp_path):
    put_shards(gcs, "gs://corpus/pile", make_documents(400), shards=4)
    raw = tiny_recipe(tmp_path / "unused.jsonl", tmp_path / "run", max_steps=20, save_steps=20)
    raw["data"]["train"] = {"path": "gs://corpus/pile/*.jsonl.gz"}
    result = hftrain.train(load_recipe(None, raw))
    loss = losses(result)
    assert loss[1] - loss[20] > 1.0
    assert any(r.startswith("GET /download/storage/v1/b/corpus/o/pile%2Fpart-") for r in gcs.requests)


def test_missing_gcs_paths_are_named(gcs):
    put_shards(gcs, "gs://bkt/corpus", make_documents(40), shards=4)
    for path in ("gs://bkt/corpus/*.parquet", "gs://bkt/corpus/part-999.jsonl.gz", "gs://nobucket/x/*.jsonl"):
        with pytest.raises(HftrainError) as info:
            read_all(path)
        assert str(info.value).startswith(f"data.train[0].path: no file matches {path!r}"), str(info.value)

    # listed now ...
    plan = plan_data(load_recipe(None, {"data": {"train": {"path": "gs://bkt/corpus/*.jsonl.gz"}}}).data, 0)
    (gcs.root / "bkt/corpus/part-002.jsonl.gz").unlink()  # ... gone when read
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    with pytest.raises(HftrainError, match=r"gs://bkt/corpus/part-002.jsonl.gz: is missing"):
        list(stream.documents(stream.fresh_state()))


def test_gcs_without_gcsfs_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if gcsfs were not installed
    with pytest.raises(HftrainError) as info:
        read_all("gs://bkt/corpus/*.jsonl.gz")
    assert str(info.value) == (
        "data.train[0].path: 'gs://bkt/corpus/*.jsonl.gz' is on Google "
        "Cloud Storage, which needs gcsfs: pip install 'hftrain[gcs]'."
    )
