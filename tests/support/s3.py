"""A real local S3 endpoint for tests, and its pytest fixtures ``s3_server`` and ``s3``.

What is real here
-----------------
* ``s3_server`` starts moto's ``ThreadedMotoServer`` (moto's own HTTP server, a werkzeug WSGI server in a
  thread) on 127.0.0.1 with a free port, once per test session, the way s3fs's own test suite does.  Every
  client talks to it over TCP with real HTTP requests: boto3/botocore, s3fs/aiobotocore/aiohttp and
  ``datasets`` streaming (through fsspec/s3fs).  Nothing in boto, botocore, aiobotocore, s3fs or fsspec is
  mocked or patched: the only thing redirected is the endpoint, through the standard environment variables
  (``AWS_ENDPOINT_URL`` and friends, see :meth:`S3Endpoint.env`), which botocore itself reads.
* ``s3`` applies those variables to ``os.environ`` for one test (monkeypatch) and clears s3fs's instance
  cache before and after, so an ``S3FileSystem()`` cached with another endpoint or credentials can't leak
  in or out of the test.

The fault-injecting proxy to put between a client and this endpoint is in ``tests.support.s3_proxy``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

REGION = "us-east-1"


def _split_url(url_or_key: str) -> tuple[str, str]:
    """'s3://bucket/key', 'bucket/key' or '/bucket/key' -> (bucket, key)."""
    path = url_or_key.split("://", 1)[1] if "://" in url_or_key else url_or_key
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket or not key:
        raise ValueError(f"expected s3://bucket/key or bucket/key, got {url_or_key!r}")
    return bucket, key


@dataclass
class S3Endpoint:
    """A running S3 endpoint (moto server) and the settings that make the real clients reach it."""

    endpoint_url: str
    key: str = "testing"
    secret: str = "testing"
    region: str = REGION
    _client: Any = field(default=None, repr=False, compare=False)

    def env(self) -> dict[str, str]:
        """The standard AWS variables that make boto3, s3fs and `datasets` reach this endpoint with no
        endpoint or storage_options argument at all; also for child processes (``{**os.environ, **env()}``).

        AWS_ENDPOINT_URL(_S3) is read by botocore (and so by aiobotocore/s3fs) for every client it builds.
        The config and credentials files point at /dev/null so a developer's ~/.aws (profiles, endpoint or
        addressing overrides, SSO) can't interfere, the EC2 metadata lookup is off (no wait for a missing
        IMDS), and 127.0.0.1 is added to NO_PROXY so an HTTP(S)_PROXY of the machine is not used for it.
        """
        no_proxy = ",".join(
            p for p in [os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or "", "127.0.0.1,localhost"] if p
        )
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    def storage_options(self) -> dict[str, Any]:
        """Explicit fsspec/s3fs options for this endpoint (``S3FileSystem(**storage_options())``)."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    def client(self) -> Any:
        """A boto3 S3 client with this endpoint given explicitly (independent of os.environ)."""
        if self._client is None:
            import boto3

            self._client = boto3.session.Session(
                aws_access_key_id=self.key, aws_secret_access_key=self.secret, region_name=self.region
            ).client("s3", endpoint_url=self.endpoint_url)
        return self._client

    def make_bucket(self, name: str | None = None) -> str:
        """Create a fresh, empty bucket and return its name (a unique one when `name` is None).

        The server lives for the whole session: pass unique names. An existing bucket is emptied."""
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass  # other regions say so; us-east-1 (like moto) just answers 200 again
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        return name

    def put(self, url_or_key: str, data: bytes | str) -> str:
        """Write an object ('s3://bucket/key' or 'bucket/key'); returns its s3:// URL."""
        bucket, key = _split_url(url_or_key)
        self.client().put_object(Bucket=bucket, Key=key, Body=data.encode() if isinstance(data, str) else data)
        return f"s3://{bucket}/{key}"

    def get(self, url_or_key: str) -> bytes:
        """Read an object back directly from the server (not through any proxy)."""
        bucket, key = _split_url(url_or_key)
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """moto's ThreadedMotoServer on 127.0.0.1 and a free port, for the whole session. Its request recorder
    (off until a test starts it, tests.support.sagemaker) writes to a temporary file, not the working directory."""
    os.environ.setdefault("MOTO_RECORDER_FILEPATH", str(tmp_path_factory.mktemp("moto") / "recording.jsonl"))
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Endpoint(endpoint_url=f"http://{host}:{port}")
    finally:
        server.stop()


def _clear_s3fs_cache() -> None:
    try:
        import s3fs
    except ImportError:  # pragma: no cover - s3fs is a test dependency
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(s3_server: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    """The session's endpoint, with its env() applied to os.environ for this test only."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    _clear_s3fs_cache()
    try:
        yield s3_server
    finally:
        _clear_s3fs_cache()
