"""SageMaker: the generated launcher against moto's SageMaker and S3 (the request moto receives), and a job's
container simulated in a temporary root (a spot restart resumes; the model lands where SageMaker packs it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hftrain.checkpoint.layout import RunLayout
from hftrain.launch.sagemaker import ENTRY_SCRIPT, METRIC_DEFINITIONS, stage_code
from hftrain.launch.sagemaker_job import metrics_line

from ..support.checks import checkpoint_losses
from ..support.cli import run_in_process
from ..support.data import make_documents, tiny_recipe, write_jsonl
from ..support.sagemaker import job_environment, make_role, recorded_requests, sagemaker_calls

pytest.importorskip("sagemaker.train", reason="the sagemaker extra (pip install 'hftrain[sagemaker]')")


def _captured(line: str) -> dict[str, float]:
    """What each metric definition captures from one printed line, as SageMaker would (first group)."""
    found = {}
    for definition in METRIC_DEFINITIONS:
        match = re.search(definition["Regex"], line)
        if match:
            found[definition["Name"]] = float(match.group(1))
    return found


def test_metric_definitions_capture_hftrain_metric_lines():
    line = metrics_line(
        10, {"loss": 2.5, "learning_rate": 6e-4, "tokens_per_s": 1234.5, "mfu": 0.31, "data_wait_frac": 0.02}
    )
    assert _captured(line) == {
        "train:loss": 2.5,
        "train:learning_rate": 6e-4,
        "train:tokens_per_s": 1234.5,
        "train:mfu": 0.31,
        "train:data_wait_frac": 0.02,
    }
    evaluation = metrics_line(10, {"eval_loss": 3.25, "eval_bits_per_byte": 1.5, "epoch": 0.1})
    assert _captured(evaluation) == {"eval:loss": 3.25, "eval:bits_per_byte": 1.5}  # `loss=` never takes eval_loss


@pytest.mark.slow
def test_launcher_submits_the_job_moto_receives(s3, tmp_path):
    import boto3

    bucket = s3.make_bucket()
    data = s3.put(f"{bucket}/corpus/train.jsonl", "".join(json.dumps({"text": d}) + "\n" for d in make_documents(50)))
    recipe = tmp_path / "recipes" / "tiny.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump(tiny_recipe(data, Path("runs/tiny"))), encoding="utf-8")  # type: ignore[arg-type]
    role = make_role(boto3.client("iam"))
    elsewhere = tmp_path / "elsewhere"  # neither the repository nor the recipe's folder
    elsewhere.mkdir()

    written = run_in_process(
        "launch-script",
        str(recipe),
        "--kind",
        "sagemaker",
        "--instance-count",
        "2",
        "--role",
        role,
        "--bucket",
        bucket,
        "--accelerate-config",
        "accelerate_configs/fsdp.yaml",
        "--channel",
        "extra",
        f"s3://{bucket}/extra",
        "training.max_steps=50",
        "training.learning_rate=1e-3",
        "--out",
        "launch_tiny.py",
        cwd=elsewhere,
    )
    assert written.returncode == 0, written.stderr[-3000:]
    # moto's IAM has no SimulatePrincipalPolicy: the SDK's client-side role check is switched off (its own variable)
    env = {**os.environ, "SAGEMAKER_VALIDATE_ROLE": "false"}
    with recorded_requests(s3.endpoint_url) as seen:
        submitted = subprocess.run(
            [sys.executable, "launch_tiny.py"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
        )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    (request,) = sagemaker_calls(seen, "CreateTrainingJob")

    assert re.fullmatch(
        r"\d+\.dkr\.ecr\.us-east-1\.amazonaws\.com/pytorch-training:2\.10-gpu-py313",
        request["AlgorithmSpecification"]["TrainingImage"],
    )
    assert request["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200}
    assert request["RoleArn"] == role and request["TrainingJobName"].startswith("hftrain-tiny-")
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 24 * 3600, "MaxWaitTimeInSeconds": 48 * 3600}
    assert request["CheckpointConfig"] == {
        "S3Uri": f"s3://{bucket}/hftrain/hftrain-tiny/checkpoints",
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert request["HyperParameters"] == {"training.max_steps": "50", "training.learning_rate": "1e-3"}
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == METRIC_DEFINITIONS
    environment = request["Environment"]
    assert environment["HFTRAIN_SAGEMAKER_CHECKPOINTS"] == "/opt/ml/checkpoints"
    assert (
        environment["ACCELERATE_USE_FSDP"] == "true" and environment["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "GPTNeoXLayer"
    )
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}
    assert channels["extra"] == f"s3://{bucket}/extra" and set(channels) == {"code", "sm_drivers", "extra"}

    # The torchrun distribution and the code: what the SDK uploaded to moto's S3 for the job's drivers.
    distributed = json.loads(s3.get(channels["sm_drivers"] + "/distributed.json"))
    assert distributed["smp"] is None and "process_count_per_node" in distributed
    source = json.loads(s3.get(channels["sm_drivers"] + "/sourcecode.json"))
    assert source["entry_script"] == ENTRY_SCRIPT and source["requirements"] == "requirements.txt"
    assert "torchrun" in s3.get(channels["sm_drivers"] + "/distributed_drivers/torchrun_driver.py").decode()
    assert (
        b"hftrain.cli" in s3.get(channels["code"] + "/" + ENTRY_SCRIPT)
        and s3.get(channels["code"] + "/tiny.yaml") == recipe.read_bytes()
    )
    assert (
        s3.get(channels["code"] + "/hftrain/launch/sagemaker_job.py")
        == Path("hftrain/launch/sagemaker_job.py").read_bytes()
    )
    required = s3.get(channels["code"] + "/requirements.txt").decode().splitlines()
    assert any(r.startswith("transformers") for r in required) and not any(re.match(r"torch\b", r) for r in required)

    described = boto3.client("sagemaker").describe_training_job(TrainingJobName=request["TrainingJobName"])
    assert described["CheckpointConfig"]["S3Uri"] == request["CheckpointConfig"]["S3Uri"]


def test_launch_script_refuses_data_a_job_cannot_read(tmp_path):
    recipe = tmp_path / "local.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "train.jsonl", tmp_path / "run")), encoding="utf-8")
    result = run_in_process("launch-script", str(recipe), "--kind", "sagemaker", cwd=tmp_path)
    assert result.returncode == 2 and "a SageMaker job cannot read" in result.stderr and "s3://" in result.stderr


def _container(
    root: Path, code: Path, channel: Path, hyperparameters: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, **job_environment(root, hyperparameters, {"train": channel})}
    return [sys.executable, str(code / ENTRY_SCRIPT)], env


@pytest.mark.slow
def test_a_spot_restart_resumes_and_leaves_the_model_where_sagemaker_packs_it(tmp_path):
    channel = tmp_path / "input" / "data" / "train"  # SageMaker copies the channel here; the recipe reads channel:train
    write_jsonl(channel / "part-0.jsonl", make_documents(400))
    recipe = tmp_path / "job.yaml"
    raw = tiny_recipe(Path("channel:train"), Path("runs/job"), max_steps=60, save_steps=60)
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    code = stage_code(recipe, tmp_path / "code")  # what the job's code channel holds
    hps = {"training.max_steps": "60"}

    first = tmp_path / "first"
    cmd, env = _container(first, code, channel, hps)
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = first / "opt/ml/checkpoints"
    deadline = time.time() + 300
    while (
        not RunLayout(checkpoints).metrics.exists() or len(RunLayout(checkpoints).metrics.read_text().splitlines()) < 10
    ) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # what SageMaker sends when spot capacity is taken back
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert not (first / "opt/ml/model/config.json").exists()

    # The restarted job runs on a new instance: SageMaker restores the checkpoint directory from S3 there.
    second = tmp_path / "second"
    shutil.copytree(checkpoints, second / "opt/ml/checkpoints")
    cmd, env = _container(second, code, channel, hps)
    done = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout and str(second / "opt/ml/checkpoints") in done.stdout
    assert sorted(checkpoint_losses(second / "opt/ml/checkpoints")) == list(range(1, 61))  # no step lost or repeated

    model = second / "opt/ml/model"
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    import transformers

    assert transformers.AutoModelForCausalLM.from_pretrained(model).num_parameters() > 0
    results = json.loads((second / "opt/ml/output/data/results.json").read_text())
    assert results["step"] == 60
    captured = [_captured(line) for line in done.stdout.splitlines()]
    assert any("train:loss" in c and "train:tokens_per_s" in c and "train:mfu" in c for c in captured)
    assert any("eval:loss" in c for c in captured)
