"""The local S3 endpoint and the fault-injecting proxy, exercised with the real clients only.

boto3/botocore, s3fs/aiobotocore/aiohttp and `datasets` streaming talk over TCP to moto's server (directly
or through FaultProxy); nothing in them is mocked.  The tests also pin down which faults each client
retries on its own, so a change of default in a client release shows up here.  As observed with botocore
1.43 / aiobotocore 3.10 / aiohttp 3.14 / s3fs 2026.9 (retry mode "legacy", the default: 5 attempts):

* boto3 ``get_object``: reset, 500 and 503 are retried by botocore (4 retries); a body cut mid-stream is
  not (``ResponseStreamingError`` from ``StreamingBody.read()``, after the call has returned).
* s3fs: a reset is first retried once by aiohttp itself (idempotent request, new connection), then by
  botocore; 500/503 by botocore; a body cut mid-stream by s3fs's ``_error_wrapper`` (``ClientPayloadError``
  is in ``S3_RETRYABLE_ERRORS``, 5 attempts); SlowDown once more by s3fs (5 x botocore's 5 attempts) while
  InternalError is not (translated to ``OSError(EREMOTEIO)``).
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .support.s3 import S3Endpoint
from .support.s3_proxy import FaultProxy

ROWS = [{"text": f"row {i}", "n": i} for i in range(50)]
JSONL = "".join(json.dumps(r) + "\n" for r in ROWS).encode()


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def blob(s3: S3Endpoint) -> tuple[str, bytes]:
    """A fresh bucket with a 300 kB random object: (bucket/key, bytes)."""
    bucket = s3.make_bucket(unique("blob"))
    data = os.urandom(300_000)
    s3.put(f"{bucket}/obj.bin", data)
    return f"{bucket}/obj.bin", data


# --- the endpoint, with env only -----------------------------------------------------------------


def test_boto3_reaches_the_endpoint_from_env_only(s3: S3Endpoint) -> None:
    import boto3

    client = boto3.client("s3")  # no endpoint_url, no credentials: AWS_ENDPOINT_URL & co. from os.environ
    assert client.meta.endpoint_url == s3.endpoint_url
    bucket = unique("boto")
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="a/b.txt", Body=b"hello")
    assert client.get_object(Bucket=bucket, Key="a/b.txt")["Body"].read() == b"hello"
    assert s3.get(f"s3://{bucket}/a/b.txt") == b"hello"  # the same server, seen with the explicit endpoint


def test_s3fs_with_no_arguments_lists_and_reads(s3: S3Endpoint) -> None:
    import s3fs

    bucket = s3.make_bucket(unique("fs"))
    s3.put(f"s3://{bucket}/dir/one.txt", b"one")
    s3.put(f"{bucket}/dir/two.txt", "two")
    fs = s3fs.S3FileSystem()
    assert sorted(fs.ls(f"{bucket}/dir")) == [f"{bucket}/dir/one.txt", f"{bucket}/dir/two.txt"]
    assert fs.cat(f"s3://{bucket}/dir/one.txt") == b"one"
    with fs.open(f"{bucket}/dir/two.txt", "rb") as f:
        assert f.read() == b"two"
    fs.pipe(f"{bucket}/dir/three.txt", b"3")
    assert s3.get(f"{bucket}/dir/three.txt") == b"3"


def test_storage_options_work_without_env(s3_server: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec
    import s3fs

    for name in s3_server.env():
        if name.startswith("AWS_"):
            monkeypatch.delenv(name, raising=False)
    bucket = s3_server.make_bucket(unique("so"))
    s3_server.put(f"{bucket}/x.txt", b"explicit")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with fsspec.open(f"s3://{bucket}/x.txt", "rb", **s3_server.storage_options()) as f:
            assert f.read() == b"explicit"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_env_reaches_a_child_process(s3_server: S3Endpoint) -> None:
    bucket = s3_server.make_bucket(unique("child"))
    s3_server.put(f"{bucket}/k", b"from parent")
    code = (
        "import boto3, sys; sys.stdout.write(boto3.client('s3').get_object(Bucket=sys.argv[1], "
        "Key='k')['Body'].read().decode())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out = subprocess.run(
        [sys.executable, "-c", code, bucket],
        env={**env, **s3_server.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "from parent"


def test_make_bucket_gives_a_fresh_bucket(s3: S3Endpoint) -> None:
    bucket = s3.make_bucket(unique("fresh"))
    s3.put(f"{bucket}/old", b"x")
    assert s3.make_bucket(bucket) == bucket
    assert s3.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert s3.make_bucket().startswith("test-")


def test_datasets_streaming_jsonl_with_env_only(s3: S3Endpoint, tmp_path: Path) -> None:
    """`datasets` streaming needs no storage_options: s3fs (created by fsspec) reads AWS_ENDPOINT_URL.

    (A `.jsonl.gz` on S3 fails in datasets 5.2 streaming: its GzipFileSystem passes aiohttp-only
    client_kwargs to s3fs; see the report, not tested here.)"""
    import datasets

    bucket = s3.make_bucket(unique("ds"))
    url = s3.put(f"{bucket}/train.jsonl", JSONL)
    ds = datasets.load_dataset("json", data_files=url, split="train", streaming=True, cache_dir=str(tmp_path))
    assert list(ds) == ROWS


# --- FaultProxy: the proxy itself ----------------------------------------------------------------


def test_proxy_forwards_and_keeps_connections_alive(s3: S3Endpoint) -> None:
    import boto3

    bucket = s3.make_bucket(unique("px"))
    with FaultProxy(s3.endpoint_url) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url)
        client.put_object(Bucket=bucket, Key="k", Body=b"v" * 1000)
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
        assert keys == ["k"]
        for _ in range(3):
            assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v" * 1000
        assert client.head_object(Bucket=bucket, Key="k")["ContentLength"] == 1000
    assert [r.method for r in proxy.requests] == ["PUT", "GET", "GET", "GET", "GET", "HEAD"]
    assert [r.status for r in proxy.requests] == [200] * 6
    assert [r.eligible for r in proxy.requests] == [None, None, 1, 2, 3, None]  # the listing is not an object GET
    assert {r.conn for r in proxy.requests} == {1}  # one keep-alive connection served them all
    assert proxy.faults == []


def test_proxy_answers_s3_errors_and_resets_on_schedule(s3: S3Endpoint) -> None:
    bucket = s3.make_bucket(unique("raw"))
    s3.put(f"{bucket}/k", b"data")
    with FaultProxy(s3.endpoint_url, schedule={1: "503", 2: "500", 4: "reset"}) as proxy:
        url = urlsplit(s3.client().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "k"}))
        path = f"{url.path}?{url.query}"  # a signed request: moto refuses anonymous reads
        conn = http.client.HTTPConnection("127.0.0.1", urlsplit(proxy.endpoint_url).port, timeout=10)
        answers = []
        for _ in range(3):  # the same keep-alive connection
            conn.request("GET", path)
            resp = conn.getresponse()
            answers.append((resp.status, resp.read()))
        assert answers[0][0] == 503 and b"<Code>SlowDown</Code>" in answers[0][1]
        assert answers[1][0] == 500 and b"<Code>InternalError</Code>" in answers[1][1]
        assert answers[2] == (200, b"data")
        conn.request("GET", path)
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            conn.getresponse()
        conn.close()
    assert [(r.eligible, r.fault, r.status, r.conn) for r in proxy.requests] == [
        (1, "503", 503, 1),
        (2, "500", 500, 1),
        (3, None, 200, 1),
        (4, "reset", None, 1),
    ]
    assert proxy.fault_counts() == {"503": 1, "500": 1, "reset": 1}


def test_proxy_only_faults_object_gets(s3: S3Endpoint) -> None:
    import boto3

    bucket = s3.make_bucket(unique("only"))
    with FaultProxy(s3.endpoint_url, every=1, every_fault="500") as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, config=_no_retries())
        client.put_object(Bucket=bucket, Key="k", Body=b"v")  # setup through the proxy is never faulted
        client.list_objects_v2(Bucket=bucket)
        client.head_object(Bucket=bucket, Key="k")
        with pytest.raises(client.exceptions.ClientError, match="InternalError"):
            client.get_object(Bucket=bucket, Key="k")
    assert [(r.method, r.fault) for r in proxy.requests] == [
        ("PUT", None),
        ("GET", None),
        ("HEAD", None),
        ("GET", "500"),
    ]


def test_proxy_every_mode_cycles_faults(s3: S3Endpoint) -> None:
    import boto3

    bucket = s3.make_bucket(unique("every"))
    s3.put(f"{bucket}/k", b"v")
    with FaultProxy(s3.endpoint_url, every=2, every_fault=["503", "500"]) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, config=_no_retries())
        outcomes = []
        for _ in range(6):
            try:
                outcomes.append(client.get_object(Bucket=bucket, Key="k")["Body"].read())
            except client.exceptions.ClientError as e:
                outcomes.append(e.response["Error"]["Code"])
    assert outcomes == [b"v", "SlowDown", b"v", "InternalError", b"v", "SlowDown"]
    assert [r.eligible for r in proxy.faults] == [2, 4, 6]
    assert proxy.fault_counts() == {"503": 2, "500": 1}


def _no_retries():
    from botocore.config import Config

    return Config(retries={"mode": "legacy", "total_max_attempts": 1})


# --- FaultProxy: what the real clients retry by default ------------------------------------------


@pytest.mark.parametrize("fault", ["reset", "midbody", "500", "503"])
def test_s3fs_cat_recovers_from_each_fault(s3: S3Endpoint, blob: tuple[str, bytes], fault: str) -> None:
    import s3fs

    path, data = blob
    with FaultProxy(s3.endpoint_url, schedule={1: fault}) as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url})
        assert fs.cat(path) == data
    assert proxy.fault_counts() == {fault: 1}
    assert len(proxy.eligible_requests) == 2  # the faulted GET and one retry


def test_s3fs_reads_full_bytes_through_mixed_faults(s3: S3Endpoint, blob: tuple[str, bytes]) -> None:
    import s3fs

    path, data = blob
    schedule = {1: "reset", 2: "500", 3: "503", 5: "midbody", 7: "503"}
    with FaultProxy(s3.endpoint_url, schedule=schedule) as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url})
        with fs.open(path, "rb", block_size=2**16, cache_type="none") as f:  # several ranged GETs
            chunks = []
            while chunk := f.read(50_000):
                chunks.append(chunk)
        assert b"".join(chunks) == data
        assert fs.cat(path) == data
    assert proxy.fault_counts() == {"reset": 1, "500": 1, "503": 2, "midbody": 1}
    assert sorted(r.eligible for r in proxy.faults) == sorted(schedule)
    assert len(proxy.eligible_requests) > max(schedule)


def test_s3fs_layers_of_retry(s3: S3Endpoint, blob: tuple[str, bytes]) -> None:
    """With botocore's own retries off, s3fs still retries SlowDown itself but not InternalError."""
    import s3fs

    path, data = blob
    no_botocore_retry = {"retries": {"mode": "legacy", "total_max_attempts": 1}}
    with FaultProxy(s3.endpoint_url, schedule={1: "503"}) as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url}, config_kwargs=no_botocore_retry)
        assert fs.cat(path) == data  # s3fs._error_wrapper matched "SlowDown" and tried again
    assert len(proxy.eligible_requests) == 2
    s3fs.S3FileSystem.clear_instance_cache()
    with FaultProxy(s3.endpoint_url, schedule={1: "500"}) as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url}, config_kwargs=no_botocore_retry)
        with pytest.raises(OSError) as info:
            fs.cat(path)
    assert info.value.errno == errno.EREMOTEIO  # ClientError InternalError, translated, not retried by s3fs
    assert len(proxy.eligible_requests) == 1


@pytest.mark.parametrize("fault", ["reset", "500", "503"])
def test_boto3_retries_reset_500_503(s3: S3Endpoint, blob: tuple[str, bytes], fault: str) -> None:
    import boto3

    path, data = blob
    bucket, key = path.split("/", 1)
    with FaultProxy(s3.endpoint_url, schedule={1: fault, 2: fault}) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url)
        assert client.meta.config.retries["mode"] == "legacy"  # botocore's default: 5 attempts in all
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert proxy.fault_counts() == {fault: 2}
    assert len(proxy.eligible_requests) == 3


def test_boto3_does_not_retry_a_body_cut_midstream(s3: S3Endpoint, blob: tuple[str, bytes]) -> None:
    """get_object() returned 200 before the body broke: botocore's retries are over, read() raises."""
    import boto3
    from botocore.exceptions import ResponseStreamingError

    path, _ = blob
    bucket, key = path.split("/", 1)
    with FaultProxy(s3.endpoint_url, schedule={1: "midbody"}) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url)
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        with pytest.raises(ResponseStreamingError):
            body.read()
    assert proxy.fault_counts() == {"midbody": 1}
    assert len(proxy.eligible_requests) == 1


def test_datasets_streaming_through_faults(s3: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import s3fs

    bucket = s3.make_bucket(unique("dsf"))
    url = s3.put(f"{bucket}/train.jsonl", JSONL)
    with FaultProxy(s3.endpoint_url, schedule={1: "503", 2: "reset", 4: "500", 5: "midbody"}) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint_url)
        s3fs.S3FileSystem.clear_instance_cache()
        ds = datasets.load_dataset("json", data_files=url, split="train", streaming=True, cache_dir=str(tmp_path))
        assert list(ds) == ROWS
        assert list(ds) == ROWS
    assert proxy.fault_counts() == {"503": 1, "reset": 1, "500": 1, "midbody": 1}
    assert proxy.requests[-1].status in (200, 206)
