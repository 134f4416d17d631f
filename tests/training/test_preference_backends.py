"""DPO on every backend and through a kill -9, as CPU rehearsals (2 gloo processes):

- full fine-tuning (a frozen reference copy, sharded by TRL as the policy is) gives the same per-step losses on
  one process, FSDP and ZeRO-3 (`hftrain parity`);
- a 2-process FSDP LoRA run (the reference is the base with the adapter disabled) killed with SIGKILL continues
  on 1 process with the uninterrupted (single-process) run's losses, reports to a tracker (trackio) and pushes to the
  local Hub a model whose card names the method;
- a combination TRL refuses is refused before any process starts.
"""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import yaml

from hftrain.checkpoint.integrity import step_of
from hftrain.checkpoint.layout import RunLayout

from ..support.checks import train_log
from ..support.cli import in_process, kill_at_checkpoint, run_cli, run_in_process
from ..support.trackers import tracker_env, trackio_metrics
from .test_preference import SHIPPED

pytestmark = pytest.mark.slow

FP32 = [
    "training.bf16=false",
    "training.fp16=false",
    "training.torch_compile=false",
    "monitor.sample_max_new_tokens=0",
    "monitor.plot=false",
]
TOKEN = "hf_localTESTtoken0123456789"


@pytest.fixture(scope="module")
def dpo_yaml(docs_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-backends")
    data = root / "pairs.jsonl"
    data.write_text("".join((SHIPPED / "preference_train.jsonl").read_text().splitlines(keepends=True)[:160]))
    raw = {
        "model": {"from_pretrained": str(docs_model)},
        "tokenizer": {"path": str(docs_model)},
        "data": {
            "train": {"path": str(data), "format": "preference"},
            "validation": {"path": str(SHIPPED / "preference_validation.jsonl"), "format": "preference"},
            "seq_len": 192,
            "eval_blocks": 16,
            "shuffle_window": 4,
        },
        "finetune": {"objective": "dpo", "method": "full", "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}},
        "training": {
            "output_dir": str(root / "unused"),
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-3,
            "warmup_steps": 0,
            "logging_steps": 1,
            "report_to": "none",
            "disable_tqdm": True,
            "seed": 7,
        },
        "monitor": {"peak_tflops": 0.1},
    }
    path = root / "dpo.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_full_dpo_gives_the_same_steps_on_one_process_fsdp_and_zero3(dpo_yaml):
    result = run_in_process(
        "parity",
        str(dpo_yaml),
        "--steps",
        "3",
        "--backends",
        "single,FSDP,ZeRO-3",
        "training.output_dir=" + str(dpo_yaml.parent / "parity"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "NO x1" in out and "FSDP x2" in out and "DEEPSPEED x2" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 3] and abs(float(rows[-1][1]) - math.log(2)) > 1e-3  # the steps trained
    loss_diff, norm_diff = (
        float(x)
        for x in out.strip().splitlines()[-1].removeprefix("parity: max relative loss diff ").split(", grad-norm diff ")
    )
    assert loss_diff < 1e-4 and norm_diff < 1e-4


def test_a_killed_2_process_lora_dpo_run_continues_on_1_reports_and_pushes(dpo_yaml, tmp_path, local_hub):
    total, every = 12, 2
    run_dir, straight = tmp_path / "killed", tmp_path / "straight"
    # the same pairs per step on 2 processes and on 1
    common = [
        *FP32,
        "finetune.method=lora",
        f"training.max_steps={total}",
        f"training.save_steps={every}",
        "training.eval_strategy=no",
        "parallelism.global_batch_size=8",
        "data.readers=2",
    ]
    cmd = [
        sys.executable,
        "-m",
        "hftrain",
        "train",
        str(dpo_yaml),
        "--accelerate-config",
        "fsdp",
        "--nproc",
        "2",
        f"training.output_dir={run_dir}",
        *common,
    ]
    survivor = kill_at_checkpoint(cmd, run_dir, 4)
    at = step_of(survivor)
    assert 4 <= at < total

    # continued on 1 FSDP process (a checkpoint loads under the backend that wrote it), reporting to trackio and
    # pushing the final model to the local Hub
    env = {**local_hub.subprocess_env(token=TOKEN, cache_dir=tmp_path / "cache"), **tracker_env(tmp_path)}
    push = [
        "training.push_to_hub=true",
        "training.hub_model_id=tester/dpo-lora",
        "training.report_to=[trackio]",
        "training.project=hftrain-dpo",
    ]
    again = run_cli(
        "train",
        str(dpo_yaml),
        "--accelerate-config",
        "fsdp",
        "--nproc",
        "1",
        f"training.output_dir={run_dir}",
        *common,
        *push,
        env=env,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {survivor}\n" in again.stdout
    done = run_in_process("train", str(dpo_yaml), f"training.output_dir={straight}", *common)  # the reference
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {e["step"]: e["loss"] for e in train_log(straight)}
    resumed = {e["step"]: e["loss"] for e in train_log(run_dir) if e["step"] > at}
    assert sorted(resumed) == list(range(at + 1, total + 1))
    assert all(resumed[s] == pytest.approx(expected[s], rel=1e-5) for s in resumed), (resumed, expected)
    assert expected[total] < expected[1] - 0.01  # the adapter trained

    tracked = trackio_metrics(tmp_path / "trackio", "hftrain-dpo")
    for key in ("loss", "rewards/margins", "rewards/accuracies", "tokens_per_s", "mfu", "eval_preference_accuracy"):
        assert tracked.get(key), (key, sorted(tracked))
    repo = local_hub.repo("tester/dpo-lora")
    card = repo.read("README.md", "main").decode()
    assert (
        "Training method: DPO (Direct Preference Optimization, TRL's "
        "DPOTrainer, beta 0.1) on preference pairs, a LoRA adapter, merged" in card
    )
    meta = yaml.safe_load(card.split("---")[1])
    assert {"dpo", "trl", "hftrain"} <= set(meta["tags"])
    assert "model.safetensors" in repo.files("main") and "eval_preference_accuracy" in card
    assert TOKEN not in again.stdout + again.stderr
    results = json.loads(RunLayout(run_dir).results.read_text())
    assert results["world_size"] == 1 and results["step"] == total


def test_a_combination_trl_refuses_is_refused_before_any_process_starts(dpo_yaml, capsys):
    started = time.monotonic()
    code, printed = in_process(
        capsys,
        "train",
        str(dpo_yaml),
        "--accelerate-config",
        "fsdp",
        "--nproc",
        "2",
        "finetune.method=lora",
        "finetune.dpo.sync_ref_model=true",
    )
    assert code == 2 and "Traceback" not in printed
    assert "finetune: dpo: sync_ref_model with method lora" in printed
    assert "torchrun" not in printed and time.monotonic() - started < 30
