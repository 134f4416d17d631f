"""Nothing hangs: every network client hftrain drives has connect and read timeouts, so an endpoint that accepts
the connection and never answers is an error naming it (exit 2, no traceback) within faults.network_timeout_s,
retries included; and the Hub's 401 says to set HF_TOKEN."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hftrain import network
from hftrain.integrations.hub import PUSH_RETRIES
from hftrain.recipe.schema import Recipe

from ..support.cli import run_in_process
from ..support.data import tiny_recipe
from ..support.hub import LocalHub
from ..support.hub_client import ClientSetup

BOUND = 3  # seconds: the recipe's faults.network_timeout_s in these tests


def _run(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """`hftrain ARGV` in this process with exactly `env` as its environment (S3 clients made anew)."""
    import s3fs

    start = time.monotonic()
    s3fs.S3FileSystem.clear_instance_cache()  # a client made for another endpoint is not reused
    try:
        result = run_in_process(*argv, env=env, exact_env=True)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    return result, time.monotonic() - start


def test_the_default_bound_is_at_most_60_seconds_retries_included():
    assert Recipe().faults.network_timeout_s == network.DEFAULT_BOUND_S <= 60
    network.configure()
    try:
        s3 = network.s3_options()["config_kwargs"]
        backoff = sum(min(1.7**i * 0.1, 15) for i in range(network.S3FS_ATTEMPTS))  # s3fs's own retry loop
        attempts = network.S3FS_ATTEMPTS * s3["retries"]["total_max_attempts"]  # botocore's inside each of s3fs's
        # + botocore's back-off (<= 2 s)
        assert attempts * s3["read_timeout"] + backoff + network.S3FS_ATTEMPTS * 2.0 <= 60
        assert s3["retries"]["total_max_attempts"] * s3["connect_timeout"] <= 60
        assert network.gcs_options()["requests_timeout"] <= 60
        http = network.http_options()["client_kwargs"]["timeout"]
        assert http.sock_connect <= 60 and http.sock_read <= 60  # fsspec's http does not retry a timed-out read
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        assert get_session().timeout.read is not None and get_session().timeout.read <= 60 / PUSH_RETRIES
        assert constants.HF_HUB_ETAG_TIMEOUT <= 60 and constants.HF_HUB_DOWNLOAD_TIMEOUT <= 60
        merged = network.storage_options_with_timeouts("s3://b/k", {"config_kwargs": {"read_timeout": 5}, "anon": True})
        assert (
            merged["anon"]
            and merged["config_kwargs"]["read_timeout"] == 5
            and merged["config_kwargs"]["connect_timeout"] == 7.5
        )
    finally:
        network.configure()


def _aws_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


@pytest.mark.slow
def test_train_from_a_silent_s3_endpoint_names_it(silent_server, tmp_path):
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(tmp_path / "unused.jsonl", tmp_path / "run")
    raw["data"]["train"] = {"path": "s3://corpus/*.jsonl"}
    raw["faults"] = {"network_timeout_s": BOUND}
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    result, took = _run(["train", str(recipe)], _aws_env(silent_server.url))
    printed = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in printed, printed[-2000:]
    assert silent_server.url in result.stderr and "timeout" in result.stderr.lower(), result.stderr
    assert took < 60 and silent_server.connections  # it did connect, and gave up well within the bound's test


def _model_dir(tmp_path: Path, bound: float | None) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt_neox"}', encoding="utf-8")
    if bound is not None:
        (model / "hftrain_recipe.yaml").write_text(
            yaml.safe_dump({"faults": {"network_timeout_s": bound}}), encoding="utf-8"
        )
    return model


@pytest.mark.slow
def test_push_to_a_silent_hub_names_it(silent_server, tmp_path, monkeypatch):
    hub = _SilentHub(silent_server.url)
    hub.patch(monkeypatch)  # this process's Hub client, as a child's would be from its environment
    env = hub.subprocess_env(token="hf_test")
    result, took = _run(["push", str(_model_dir(tmp_path, BOUND)), "--repo-id", "tester/silent"], env)
    printed = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in printed, printed[-2000:]
    assert "creating hub repo tester/silent failed after" in result.stderr and silent_server.url in result.stderr, (
        result.stderr
    )
    assert "no answer within the network time limit (3 s" in result.stderr
    assert took < 60 and "hf_test" not in printed


class _SilentHub(ClientSetup):
    """The Hub client's environment (as for LocalHub) pointed at the silent server."""

    def __init__(self, url: str):
        self.endpoint, self.token_path = url, os.devnull + "-no-token"


@pytest.mark.slow
def test_a_refused_token_says_to_set_hf_token(tmp_path, monkeypatch):
    with LocalHub(valid_tokens={"hf_the_right_one"}) as hub:
        hub.patch(monkeypatch)
        env, endpoint = hub.subprocess_env(token="hf_PLANTED_wrong_token"), hub.endpoint
        result, _ = _run(["push", str(_model_dir(tmp_path, None)), "--repo-id", "tester/denied"], env)
    printed = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in printed, printed[-2000:]
    expected = (
        f"creating hub repo tester/denied failed after 1 attempt: {endpoint}: "
        "401 Unauthorized: the Hub refused the token. Set HF_TOKEN"
    )
    assert expected in result.stderr, result.stderr
    assert "hf_PLANTED_wrong_token" not in printed


@pytest.mark.slow
def test_s3_without_credentials_and_a_refused_endpoint(tmp_path):
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(tmp_path / "unused.jsonl", tmp_path / "run")
    raw["data"]["train"] = {"path": "s3://corpus/*.jsonl"}
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env = _aws_env("http://127.0.0.1:9")  # nothing listens on the discard port
    refused, took = _run(["train", str(recipe)], env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and took < 60, refused.stderr[-2000:]
    assert "http://127.0.0.1:9: cannot connect (" in refused.stderr, refused.stderr
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    missing, _ = _run(["train", str(recipe)], env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
    assert "S3: no credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in missing.stderr
