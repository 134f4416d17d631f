"""Bad input, table-driven: each case gets its exact message through the CLI's own entry point, in this process
(exit 2, no traceback: an exception other than hftrain's one-line error escapes `main` and fails the case).
And secrets: planted tokens and keys never reach a file a run writes or anything it prints."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .support.cli import in_process
from .support.data import make_documents, tiny_recipe, write_jsonl
from .support.trackers import tracker_env


def _case_files(tmp: Path) -> dict[str, Path]:
    good = write_jsonl(tmp / "good.jsonl", make_documents(300))
    bad = tmp / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    field = write_jsonl(tmp / "field.jsonl", ["x"], field="body")
    empty = tmp / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    notdir = tmp / "not-a-model"
    notdir.mkdir(exist_ok=True)
    return {"good": good, "bad": bad, "field": field, "empty": empty, "notdir": notdir}


# (name, recipe changes as dotted overrides, expected message fragment)
CASES = [
    ("unknown key", ["training.learnig_rate=1"], "training.learnig_rate: unknown key; did you mean training.learning_rate?"),
    ("wrong type", ["training.max_steps=many"], "training.max_steps: Input should be a valid integer"),
    ("unknown preset", ["model.preset=pythia-160"], "model.preset: unknown preset 'pythia-160'; did you mean pythia-160m?"),
    ("token in recipe", ["training.hub_token=hf_abc"], "training.hub_token: tokens never go in a recipe"),
    ("two tokenizers", ["tokenizer.builtin=gpt2"], "tokenizer: give only one of builtin, path or train (got builtin, train)"),
    ("no max_steps", ["training.max_steps=-1"], "training.max_steps: required. hftrain streams its data"),
    ("missing file", ["data.train.path={tmp}/nope.jsonl"], "data.train[0].path: no file matches '{tmp}/nope.jsonl'"),
    ("empty glob", ["data.train.path={tmp}/*.parquet"], "data.train[0].path: no file matches '{tmp}/*.parquet'"),
    ("malformed line", ["data.train.path={bad}"], "{bad}:2: not valid JSON"),
    ("missing field", ["data.train.path={field}"], "{field}:1: no string field 'text' (has: body)"),
    ("empty corpus", ["data.train.path={empty}"], "data.train[0]: no documents found in {empty}"),
    ("seq_len too long", ["data.seq_len=4096"], "data.seq_len: 4096 is longer than the model's context (max_position_embeddings = 512)"),
    ("vocab too small", ["model.vocab_size=64"], "model.vocab_size: 64 embedding rows cannot hold the tokenizer's 320 tokens"),
    ("bad model path", ["model.from_pretrained={notdir}", "tokenizer.train=null", "tokenizer.builtin=gpt2"], "model.from_pretrained: cannot load '{notdir}'"),
    ("bad tokenizer path", ["tokenizer.path={notdir}", "tokenizer.train=null"], "tokenizer.path: cannot load a tokenizer from '{notdir}'"),
    ("strategy mismatch", ["parallelism.strategy=fsdp"], "parallelism.strategy: the recipe asks for FSDP, but this process was launched as single"),
    ("global batch", ["parallelism.global_batch_size=12"], "parallelism.global_batch_size: 12 sequences cannot be split into micro-batches of 8"),
    ("bad override", ["max_steps"], None),  # not key=value: argparse takes it as an extra argument
]


@pytest.mark.parametrize("name, changes, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_its_message(capsys, tmp_path, name, changes, expected):
    files = _case_files(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(files["good"], tmp_path / "run")), encoding="utf-8")
    fill = {"tmp": str(tmp_path), **{k: str(v) for k, v in files.items()}}
    code, printed = in_process(capsys, "train", str(recipe), *(c.format(**fill) for c in changes))
    assert code == 2, (code, printed[-2000:])
    assert "Traceback" not in printed
    if expected is not None:
        assert expected.format(**fill) in printed, printed[-2000:]


SECRETS = {"HF_TOKEN": "hf_PLANTEDsecretTOKEN0123456789", "AWS_SECRET_ACCESS_KEY": "PLANTEDawsSECRETkey/0123456789abcdef",
           "AWS_SESSION_TOKEN": "PLANTEDsessionTOKEN9876543210"}  # fmt: skip


@pytest.mark.slow
def test_planted_secrets_never_leak(tmp_path, s3_server, capsys, monkeypatch):
    """Secrets in the environment and in the recipe (storage_options) appear in no file and no output."""
    bucket = s3_server.make_bucket()
    s3_server.put(f"{bucket}/c.jsonl", "".join(f'{{"text": "{d}"}}\n' for d in make_documents(300)))
    raw = tiny_recipe(tmp_path / "unused", tmp_path / "run", max_steps=6, save_steps=3)
    raw["data"]["train"] = {"path": f"s3://{bucket}/c.jsonl",
                            "storage_options": {"secret": s3_server.secret + "", "key": s3_server.key}}  # fmt: skip
    trackers = [name for name in ("trackio", "wandb", "mlflow") if importlib.util.find_spec(name)]
    raw["training"]["report_to"] = ["tensorboard", *trackers]  # and what each tracker stores (test_trackers.py)
    raw["monitor"]["plot"] = True
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env = {**os.environ, **s3_server.env(), **tracker_env(tmp_path / "trackers"), **SECRETS}
    env["AWS_SECRET_ACCESS_KEY"] = s3_server.secret  # the endpoint needs the real one; the planted ones ride along
    env["HFTRAIN_TEST_PLANTED"] = SECRETS["AWS_SECRET_ACCESS_KEY"]
    result = subprocess.run([sys.executable, "-m", "hftrain", "train", str(recipe)], capture_output=True, text=True,
                            env=env, timeout=600)  # fmt: skip
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
