"""Preemption: SIGTERM mid-run saves at the next step and exits 75; running again loses no step."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hftrain.checkpoint import manager as ckpt
from hftrain.checkpoint.layout import RunLayout

from ..support.checks import assert_resumed_matches, checkpoint_losses, metrics_losses
from ..support.cli import in_background, kill_family, run_cli, run_in_process
from ..support.data import make_documents, tiny_recipe, write_jsonl


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_resume_loses_nothing(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(400))
    recipe = tmp_path / "r.yaml"
    raw = tiny_recipe(data, tmp_path / "unused", max_steps=120, save_steps=120, logging_steps=1)
    recipe.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe)]

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [*cmd, f"training.output_dir={interrupted}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = RunLayout(interrupted).metrics
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 10) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    saved = ckpt.latest_checkpoint(interrupted)
    step = int(saved.name.split("-")[1])
    assert f"stopped by SIGTERM after step {step}" in err and "Run the same command again" in err
    assert 10 <= step < 120 and not RunLayout(interrupted).final.exists()

    # the resume: a new start, in this process
    again = run_in_process("train", str(recipe), f"training.output_dir={interrupted}")
    assert again.returncode == 0, again.stderr[-2000:]
    straight = tmp_path / "straight"
    done = run_in_process("train", str(recipe), f"training.output_dir={straight}")
    assert done.returncode == 0, done.stderr[-2000:]
    resumed, reference = checkpoint_losses(interrupted), checkpoint_losses(straight)
    assert sorted(resumed) == list(range(1, 121))  # no step lost or repeated
    assert_resumed_matches(reference, resumed, range(step + 1, 121))


def _recipe_file(tmp_path, **training):
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(400))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(data, tmp_path / "unused", **training)))
    return path


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"step {step} not reached")


@pytest.mark.slow
def test_kill_9_at_a_random_step_loses_at_most_save_steps(tmp_path):
    import random

    k = 7
    recipe = _recipe_file(tmp_path, max_steps=80, save_steps=k, logging_steps=1, save_total_limit=1)
    cmd = [sys.executable, "-m", "hftrain", "train", str(recipe)]
    killed_at = random.Random().randint(k + 1, 60)  # the test picks the step
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [*cmd, f"training.output_dir={run_dir}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _wait_for_step(RunLayout(run_dir).metrics, killed_at, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    survivor = ckpt.latest_checkpoint(run_dir)
    lost = killed_at - int(survivor.name.split("-")[1])
    assert 0 <= lost <= k + 1, (killed_at, survivor)  # +1: the kill may land a step after the one observed
    # the resume: a new start, in this process
    again = run_in_process("train", str(recipe), f"training.output_dir={run_dir}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from {survivor}" in again.stdout
    straight = run_in_process("train", str(recipe), f"training.output_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0
    resumed, reference = checkpoint_losses(run_dir), checkpoint_losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(1, 81))
    assert_resumed_matches(reference, resumed, range(1, 81))


KILL_INSIDE_SAVE = """
import os, signal, sys
import safetensors.torch as st
real = st.save_file
calls = {"n": 0}
def dying_save(tensors, filename, metadata=None):
    calls["n"] += 1
    if calls["n"] == 2:  # the second checkpoint: die half-way through writing its weights
        with open(filename, "wb") as f:
            f.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, filename, metadata=metadata)
st.save_file = dying_save
import transformers.modeling_utils as mu
mu.safe_save_file = dying_save
from hftrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_inside_a_save_keeps_the_previous_checkpoint(tmp_path):
    recipe = _recipe_file(tmp_path, max_steps=30, save_steps=10, logging_steps=1)
    run_dir = tmp_path / "run"
    died = subprocess.run(
        [sys.executable, "-c", KILL_INSIDE_SAVE, "train", str(recipe), f"training.output_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert died.returncode == -signal.SIGKILL
    assert [p.name for p in ckpt.complete_checkpoints(run_dir)] == ["checkpoint-10"]
    assert (run_dir / RunLayout.STAGING / "checkpoint-20").is_dir()  # the half-written one, never renamed into place
    again = run_in_process("train", str(recipe), f"training.output_dir={run_dir}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "removed" in again.stdout and "resuming from" in again.stdout and "checkpoint-10" in again.stdout
    assert not (run_dir / RunLayout.STAGING).exists()
    assert [p.name for p in ckpt.complete_checkpoints(run_dir)] == ["checkpoint-20", "checkpoint-30"]


FULL_DISK = {  # what each writer raises when the disk fills: safetensors (an OSError), torch.save (a RuntimeError)
    "weights": (OSError(28, "No space left on device"), "(No space left on device)"),
    "optimizer": (
        RuntimeError(
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter "
            "failed writing file data/3: file write failed"
        ),
        "(the disk is full or refused a write: RuntimeError: [enforce fail",
    ),
}


@pytest.mark.parametrize("writer", FULL_DISK)
def test_disk_full_during_a_save_is_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, corpus, writer):
    import safetensors.torch as st
    import torch
    import transformers.modeling_utils as mu

    import hftrain
    from hftrain.errors import HftrainError

    error, expected = FULL_DISK[writer]
    real, calls = (st.save_file, torch.save)[writer == "optimizer"], {"n": 0}

    def full_disk(obj, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            Path(filename).write_bytes(b"half")
            raise error
        return real(obj, filename, *args, **kwargs)

    if writer == "weights":
        monkeypatch.setattr(mu, "safe_save_file", full_disk)
    else:  # the Trainer's optimizer state goes through torch.save

        def save(obj, f, *args, **kwargs):
            return (full_disk if str(f).endswith("optimizer.pt") else real)(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    raw = tiny_recipe(corpus, tmp_path / "run", max_steps=20, save_steps=10)
    with pytest.raises(HftrainError) as info:
        hftrain.train(hftrain.load_recipe(None, raw))
    message = str(info.value)
    assert f"could not write {tmp_path / 'run' / 'checkpoint-20'} {expected}" in message
    assert f"The last complete checkpoint {tmp_path / 'run' / 'checkpoint-10'} is intact" in message
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "run")] == ["checkpoint-10"]
    assert not (tmp_path / "run" / RunLayout.STAGING / "checkpoint-20").exists()


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_is_caught_at_once(tmp_path, monkeypatch, corpus, policy):
    import functools

    import torch
    from transformers import GPTNeoXForCausalLM

    import hftrain
    from hftrain.errors import HftrainError

    real, calls = GPTNeoXForCausalLM.forward, {"n": 0}

    @functools.wraps(real)  # the Trainer reads forward's signature to find the labels
    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 6:  # the 6th training step
                out.loss = out.loss * torch.tensor(float("nan"))
        return out

    monkeypatch.setattr(GPTNeoXForCausalLM, "forward", poisoned)
    raw = tiny_recipe(corpus, tmp_path / "run", max_steps=10, save_steps=5, logging_steps=1)
    raw["faults"] = {"on_nonfinite": policy}
    if policy == "stop":
        with pytest.raises(HftrainError) as info:
            hftrain.train(hftrain.load_recipe(None, raw))
        assert "non-finite loss or gradient norm (nan) at step 6; stopped (faults.on_nonfinite=stop)" in str(info.value)
        assert f"the last good checkpoint is {tmp_path / 'run' / 'checkpoint-5'}" in str(info.value)
        return
    run = hftrain.train(hftrain.load_recipe(None, raw))
    assert run.trainer.skipped_steps == [6]
    losses = metrics_losses(tmp_path / "run")  # the skipped step's line says it had no loss (before: 0.0)
    assert math.isnan(losses[6]) and all(0 < loss < 20 for step, loss in losses.items() if step != 6), losses
    params = [p for p in run.trainer.model.parameters()]
    assert all(torch.isfinite(p).all() for p in params)  # the poisoned step never reached the weights
    assert run.metrics["eval_loss"] < 5.0


@pytest.mark.slow
def test_max_restarts_resumes_after_a_crash(tmp_path):
    import psutil

    recipe = _recipe_file(tmp_path, max_steps=60, save_steps=10, logging_steps=1)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hftrain",
            "train",
            str(recipe),
            "--max-restarts",
            "2",
            f"training.output_dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(RunLayout(run_dir).metrics, 25, proc)
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()  # the training process dies; its supervisor stays
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert "training died (signal SIGKILL); restart 1 of 2, resuming from the last complete checkpoint" in err
    assert json.loads(RunLayout(run_dir).results.read_text())["step"] == 60


@pytest.mark.slow(seconds=90)  # the suite's order: the longest files start first (tests/conftest.py)
def test_kill_9_of_a_two_process_run_streaming_from_s3(tmp_path, s3):
    import gzip
    import os
    import random
    import signal

    import psutil

    bucket = s3.make_bucket()
    docs = make_documents(600)
    for i in range(4):
        s3.put(
            f"{bucket}/c/part-{i}.jsonl.gz",
            gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in docs[i::4]).encode()),
        )
    raw = tiny_recipe(tmp_path / "unused", tmp_path / "unused", max_steps=40, save_steps=5, logging_steps=1)
    raw["data"]["train"] = {"path": f"s3://{bucket}/c/*.jsonl.gz"}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    args = ["train", str(recipe), "--accelerate-config", "ddp", "--nproc", "2"]
    cmd = [sys.executable, "-m", "hftrain", *args]
    env = {**os.environ, **s3.env()}
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [*cmd, f"training.output_dir={run_dir}"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_step(RunLayout(run_dir).metrics, random.Random().randint(7, 30), proc)
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:  # frozen mid-run (as a hung run would be): it still owns its directory
        os.kill(pid, signal.SIGSTOP)
    second = subprocess.run(
        [*cmd, f"training.output_dir={run_dir}"], env=env, capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 2, second.stderr[-2000:]  # an independent second launch (issue 33, class 1)
    assert f"training.output_dir: {run_dir} is in use by another hftrain process: pid {proc.pid} on" in second.stderr
    assert "Traceback" not in second.stderr and second.stderr.count("hftrain: error:") == 1
    kill_family(proc)  # every process of the run at once: launcher, torchrun and both ranks
    assert not RunLayout(run_dir).final.exists()
    survivor = ckpt.latest_checkpoint(run_dir)
    assert survivor is not None
    uninterrupted = in_background(lambda: run_cli(*args, f"training.output_dir={tmp_path / 'straight'}", env=s3.env()))
    again = run_cli(*args, f"training.output_dir={run_dir}", env=s3.env())
    assert again.returncode == 0, again.stderr[-2000:]
    straight = uninterrupted.result()
    assert straight.returncode == 0, straight.stderr[-2000:]
    resumed, reference = checkpoint_losses(run_dir), checkpoint_losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(1, 41))
    assert_resumed_matches(reference, resumed, range(1, 41))
