"""Sharing models: push to a local Hub-compatible server through the real huggingface_hub client, and to S3."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import hftrain
from hftrain.errors import HftrainError

from ..support.cli import run_in_process
from ..support.data import tiny_recipe

TOKEN = "hf_localTESTtoken0123456789"


def digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_push_during_training_then_load_from_the_hub(local_hub, monkeypatch, tmp_path, corpus, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    raw = tiny_recipe(corpus, tmp_path / "run", max_steps=10, save_steps=5)
    raw["training"].update(
        push_to_hub=True, hub_model_id="tester/tiny-neox", hub_private_repo=True, hub_strategy="checkpoint"
    )
    raw["monitor"]["plot"] = True
    run = hftrain.train(hftrain.load_recipe(None, raw))
    final_files = digest(run.final_dir)
    assert TOKEN in local_hub.tokens_seen
    repo = local_hub.repo("tester/tiny-neox")
    assert repo.private
    files = set(repo.files("main"))
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "README.md",
        "training_curves.png",
        "hftrain_recipe.yaml",
        "metrics.jsonl",
        "last-checkpoint/model.safetensors",
    } <= files
    assert not any("optimizer" in f or f.endswith(".bin") for f in files)
    card = repo.read("README.md", "main").decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and "hftrain" in meta["tags"] and meta["license"] == "apache-2.0"
    assert "| eval_loss |" in card and "![loss and gradient norm against step](training_curves.png)" in card
    assert 'AutoModelForCausalLM.from_pretrained("tester/tiny-neox")' in card
    model = AutoModelForCausalLM.from_pretrained("tester/tiny-neox", token=TOKEN).eval()
    tok = AutoTokenizer.from_pretrained("tester/tiny-neox", token=TOKEN)
    ids = tok("the red fox sees the old owl.", return_tensors="pt")["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(run.final_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, local(ids).logits)
    assert digest(run.final_dir) == final_files  # a push never alters the local model
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_push_command_to_a_branch(local_hub, pretrained_run, tmp_path, monkeypatch):
    from hftrain.integrations import publish

    staged, real_push = [], publish.push_folder
    monkeypatch.setattr(
        publish,
        "push_folder",
        lambda folder, *args, **kwargs: staged.append(folder) or real_push(folder, *args, **kwargs),
    )
    env = local_hub.subprocess_env(token=TOKEN, cache_dir=tmp_path / "cache")
    result = run_in_process(
        "push",
        str(pretrained_run.output_dir),
        "--repo-id",
        "tester/cli",
        "--revision",
        "dev",
        "--private",
        env=env,
        exact_env=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pushed: hub:tester/cli@dev" in result.stdout
    # beside the model: hard links
    assert staged and all(Path(folder).parent == Path(pretrained_run.output_dir) for folder in staged)
    assert not list(Path(pretrained_run.output_dir).glob("hftrain-push-*"))  # and removed
    assert TOKEN not in result.stdout + result.stderr
    repo = local_hub.repo("tester/cli")
    assert "model.safetensors" in repo.files("dev") and "model.safetensors" not in repo.files("main")
    model = AutoModelForCausalLM.from_pretrained("tester/cli", revision="dev", token=TOKEN)
    assert model.config.model_type == "gpt_neox"


def test_push_to_s3(s3, pretrained_run):
    bucket = s3.make_bucket()
    url = pretrained_run.push(to=f"s3://{bucket}/models/tiny")
    assert url == f"s3://{bucket}/models/tiny"
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"models/tiny/model.safetensors", "models/tiny/config.json", "models/tiny/tokenizer.json"} <= keys
    assert (
        s3.get(f"{bucket}/models/tiny/model.safetensors")
        == (pretrained_run.final_dir / "model.safetensors").read_bytes()
    )


def test_unreachable_hub_is_retried_and_reported(local_hub, monkeypatch, pretrained_run):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr("hftrain.integrations.hub.time.sleep", lambda s: None)
    local_hub.stop()
    before = digest(pretrained_run.final_dir)
    with pytest.raises(HftrainError) as info:
        pretrained_run.push("tester/gone")
    assert "creating hub repo tester/gone failed after 3 attempts" in str(info.value)
    assert TOKEN not in str(info.value)
    assert digest(pretrained_run.final_dir) == before


@pytest.mark.slow
def test_checkpoints_and_final_model_copied_to_s3_during_training(s3, tmp_path, corpus):
    bucket = s3.make_bucket()
    raw = tiny_recipe(corpus, tmp_path / "run", max_steps=10, save_steps=5)
    raw["hub"] = {"s3_uri": f"s3://{bucket}/models/tiny"}  # hub_strategy every_save (the Trainer's default)
    hftrain.train(hftrain.load_recipe(None, raw))
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    for folder in ("checkpoint-5", "checkpoint-10", "final"):
        assert f"models/tiny/{folder}/model.safetensors" in keys, folder
    assert "models/tiny/checkpoint-5/optimizer.pt" in keys  # a checkpoint copy resumes elsewhere


def test_training_data_from_an_hf_url(local_hub, monkeypatch, tmp_path):
    """hf:// paths go through huggingface_hub's fsspec filesystem, like s3:// through s3fs."""
    import json

    from huggingface_hub import HfApi, HfFileSystem

    from hftrain.data.loader import plan_data
    from hftrain.data.stream import DocumentStream

    from ..support.data import make_documents

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    HfFileSystem.clear_instance_cache()
    docs = make_documents(30)
    api = HfApi()
    api.create_repo("tester/corpus", repo_type="dataset")
    api.upload_file(
        path_or_fileobj="".join(json.dumps({"text": d}) + "\n" for d in docs).encode(),
        path_in_repo="data/train.jsonl",
        repo_id="tester/corpus",
        repo_type="dataset",
    )
    section = hftrain.load_recipe(None, {"data": {"train": {"path": "hf://datasets/tester/corpus/data/*.jsonl"}}}).data
    plan = plan_data(section, 0)
    stream = DocumentStream(plan.train, seed=0, shuffle=False, loop=False)
    assert list(stream.documents(stream.fresh_state())) == docs
    HfFileSystem.clear_instance_cache()


@pytest.mark.slow
def test_kept_checkpoints_are_revisions_that_transformers_loads(local_hub, monkeypatch, tmp_path, corpus, capsys):
    """checkpoints.push_revisions: each kept checkpoint (step 0: the initial weights) becomes branch stepN in the
    background while training goes on
    (the push of step1 waits until checkpoint-4 exists: a push that blocked training would never see it), a push that
    fails is reported and training goes on, the final model goes to main with a card listing the revisions, and plain
    transformers loads a revision as the local checkpoint it came from. Rotation leaves kept checkpoints alone."""
    import time

    from hftrain.checkpoint.layout import RunLayout
    from hftrain.integrations import revisions

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    run_dir = tmp_path / "run"
    real_push = revisions.push_folder

    def push(folder, repo_id, *, revision, **kwargs):
        assert Path(folder).is_relative_to(run_dir), folder  # the model-sized export in the run's folder, not in /tmp
        if revision == "step1":  # slow: training must go on meanwhile
            deadline = time.monotonic() + 120
            while not (run_dir / "checkpoint-4" / "hftrain_complete.json").is_file():
                assert time.monotonic() < deadline, "training waited for a revision push"
                time.sleep(0.05)
        if revision == "step2":
            raise HftrainError(f"pushing {folder} to {repo_id} failed after 3 attempts: 503 Service Unavailable")
        return real_push(folder, repo_id, revision=revision, **kwargs)

    monkeypatch.setattr(revisions, "push_folder", push)
    raw = tiny_recipe(corpus, run_dir, max_steps=8, save_steps=3, save_total_limit=1)
    raw["training"].update(push_to_hub=True, hub_model_id="tester/pythia-style", hub_strategy="end")
    raw["checkpoints"] = {"schedule": "log", "log_until": 4, "steps": [5], "push_revisions": True}
    hftrain.train(hftrain.load_recipe(None, raw))
    printed = capsys.readouterr()
    said = printed.out + printed.err

    kept = [1, 2, 4, 5]
    # + the newest rotating one
    assert sorted(int(c.name.split("-")[1]) for c in run_dir.glob("checkpoint-*")) == [*kept, 8]
    assert "hftrain: pushed checkpoint-1 to tester/pythia-style as revision step1" in said
    assert (
        "hftrain: warning: pushing checkpoint-2 as revision step2 of tester/pythia-style failed (pushing" in said
        and f"`hftrain export {run_dir / 'checkpoint-2'} --merge --out DIR`" in said
    )
    repo = local_hub.repo("tester/pythia-style")
    assert sorted(repo.branches) == ["main", "step0", "step1", "step4", "step5"]
    card = repo.read("README.md", "main").decode()
    assert "Kept checkpoints are branches of this repo (4): `step0`, `step1`, `step4`, `step5`." in card
    assert 'from_pretrained("tester/pythia-style", revision="step5")' in card
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(repo.files("step4"))
    assert not any("optimizer" in f or f.startswith("hftrain_data_state") for f in repo.files("step4"))
    ids = torch.tensor([[5, 17, 42, 7, 99]])
    for step in (0, 4, 5):  # step 0: the initialization, kept as initial/
        remote = AutoModelForCausalLM.from_pretrained("tester/pythia-style", revision=f"step{step}", token=TOKEN).eval()
        local = AutoModelForCausalLM.from_pretrained(run_dir / (f"checkpoint-{step}" if step else "initial")).eval()
        with torch.no_grad():
            torch.testing.assert_close(remote(ids).logits, local(ids).logits, rtol=0, atol=0)
    main = AutoModelForCausalLM.from_pretrained("tester/pythia-style", token=TOKEN).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            main(ids).logits, AutoModelForCausalLM.from_pretrained(RunLayout(run_dir).final).eval()(ids).logits
        )
    assert TOKEN not in said
