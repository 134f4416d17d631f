"""Secrets and outside services: planted tokens and keys, in the environment, in the recipe and of every kind by
value, never reach a file a run writes, a tracker, a model card, an error or anything printed (class 2 of the third
pass: what may be saved is decided by what the field is); an http(s) source that never answers is an error within
faults.network_timeout_s (class 4; the other clients: tests/integrations/test_network.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import yaml

from hftrain.cli import main

from ..support.checks import tree_digest
from ..support.cli import in_process
from ..support.data import make_documents, tiny_recipe
from ..support.trackers import tracker_env

SECRETS = {
    "HF_TOKEN": "hf_PLANTEDsecretTOKEN0123456789",
    "AWS_SECRET_ACCESS_KEY": "PLANTEDawsSECRETkey/0123456789abcdef",
    "AWS_SESSION_TOKEN": "PLANTEDsessionTOKEN9876543210",
}


@pytest.mark.slow
def test_planted_secrets_never_leak(tmp_path, s3_server, capsys, monkeypatch):
    """Secrets in the environment and in the recipe (storage_options) appear in no file and no output."""
    bucket = s3_server.make_bucket()
    s3_server.put(f"{bucket}/c.jsonl", "".join(f'{{"text": "{d}"}}\n' for d in make_documents(300)))
    raw = tiny_recipe(tmp_path / "unused", tmp_path / "run", max_steps=6, save_steps=3)
    raw["data"]["train"] = {
        "path": f"s3://{bucket}/c.jsonl",
        "storage_options": {"secret": s3_server.secret + "", "key": s3_server.key},
    }
    trackers = [name for name in ("trackio", "wandb", "mlflow") if importlib.util.find_spec(name)]
    raw["training"]["report_to"] = ["tensorboard", *trackers]  # and what each tracker stores (test_trackers.py)
    raw["monitor"]["plot"] = True
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env = {**os.environ, **s3_server.env(), **tracker_env(tmp_path / "trackers"), **SECRETS}
    env["AWS_SECRET_ACCESS_KEY"] = s3_server.secret  # the endpoint needs the real one; the planted ones ride along
    env["HFTRAIN_TEST_PLANTED"] = SECRETS["AWS_SECRET_ACCESS_KEY"]
    result = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", str(recipe)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    bad_recipe = yaml.safe_load(recipe.read_text())
    bad_recipe["training"]["learnig_rate"] = 1
    recipe.write_text(yaml.safe_dump(bad_recipe))
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    code, refused = in_process(capsys, "train", str(recipe), f"training.hub_token={SECRETS['HF_TOKEN']}")
    assert code == 2 and "training.hub_token: tokens never go in a recipe" in refused
    printed = result.stdout + result.stderr + refused
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 20
    stored = [p for p in (tmp_path / "trackers").rglob("*") if p.is_file()]
    assert len(stored) >= (10 if trackers else 0), stored  # the trackers' databases, run files and logs
    files += stored
    for secret in [SECRETS["HF_TOKEN"], SECRETS["AWS_SESSION_TOKEN"], SECRETS["AWS_SECRET_ACCESS_KEY"]]:
        assert secret not in printed
        for path in files:
            assert secret.encode() not in path.read_bytes(), path


# Class 2, secrets by value: what may be saved is decided by what the field is. Planted values of every kind, under
# names that do not look secret, never reach a saved recipe, a model card or an error message.
# Class 2, secrets by value: what may be saved is decided by what the field is. Planted values of every kind, under
# names that do not look secret, never reach a saved recipe, a model card or an error message.
PLANTED = {
    "header": ("storage_options", {"client_kwargs": {"headers": {"Authorization": "Bearer PLANTEDheader0123"}}}),
    "custom credential field": ("storage_options", {"account_key": "PLANTEDaccountKEY0123"}),
    "access key id": ("storage_options", {"key": "AKIAPLANTEDKEYID0123"}),
    "endpoint with user info": (
        "storage_options",
        {"endpoint_url": "https://admin:PLANTEDendpointPW@store.example:9000"},
    ),
    "data URL with user info": ("path", "https://reader:PLANTEDpathPW@data.example/corpus.jsonl"),
}


@pytest.mark.parametrize("kind", PLANTED)
def test_a_planted_secret_of_any_kind_is_never_saved_or_printed(capsys, work, kind):
    from hftrain.checkpoint.part import CheckpointPart
    from hftrain.integrations.hub import model_card
    from hftrain.integrations.publish import PublishPart
    from hftrain.recipe.load import load_recipe

    where, value = PLANTED[kind]
    secret = next(
        word for word in str(value).replace("'", " ").replace(":", " ").replace("@", " ").split() if "PLANTED" in word
    )
    raw = yaml.safe_load((work / "r.yaml").read_text())
    raw["data"]["train"] = {
        "path": str(work / "good.jsonl"),
        "storage_options": {"anon": True, "config_kwargs": {"read_timeout": 7}},
    }
    if where == "path":
        raw["data"]["train"]["path"] = value
    else:
        raw["data"]["train"]["storage_options"].update(value)
    recipe = load_recipe(None, raw)
    saved = CheckpointPart.of(recipe).recipe_yaml  # what every checkpoint saves as hftrain_recipe.yaml
    assert secret not in saved and secret not in model_card(PublishPart.of(recipe), {}, "me/model", False)
    kept = yaml.safe_load(saved)["data"]["train"][0]["storage_options"]
    assert kept["anon"] is True and kept["config_kwargs"] == {"read_timeout": 7}  # settings stay, to explain the run
    if kind == "data URL with user info":  # the error that names the path keeps its host, not its password
        raw["faults"] = {"network_timeout_s": 1}
        (work / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
        code = main(["data", "inspect", str(work / "r.yaml")])
        printed = capsys.readouterr()
        assert code == 2 and secret not in printed.err + printed.out and "https://***@data.example" in printed.err, (
            printed.err
        )


# Class 4, every network client bounded: an http(s):// data source at a server that accepts and never answers is an
# error within faults.network_timeout_s (it hung before: aiohttp's default has no read limit).
@pytest.mark.parametrize("scheme, command", [("http", "train"), ("https", "train"), ("http", "data")])
def test_a_silent_http_source_is_an_error_within_the_bound(capsys, work, silent_server, scheme, command):
    from hftrain import network

    url = silent_server.url.replace("http://", f"{scheme}://") + "/corpus/part-0.jsonl"
    raw = yaml.safe_load((work / "r.yaml").read_text())
    raw["data"]["train"] = {"path": url}
    raw["faults"] = {"network_timeout_s": 2}
    (work / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    before = tree_digest(work)
    argv = ["train", str(work / "r.yaml")] if command == "train" else ["data", "inspect", str(work / "r.yaml")]
    started = time.monotonic()
    try:
        code = main(argv)
    finally:
        network.configure()  # this process's default bound again
    took = time.monotonic() - started
    printed = capsys.readouterr()
    assert code == 2, printed.err[-2000:]
    assert (
        f"cannot list {url!r}: the endpoint: no answer within the network time limit (2 s, retries included)"
        in printed.err
    )
    assert "Traceback" not in printed.err + printed.out and silent_server.connections
    assert took < 15, took
    assert tree_digest(work) == before
