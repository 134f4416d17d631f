"""Experiment trackers through the Trainer's own integrations (`training.report_to`), each read back from its
local storage: trackio (SQLite under TRACKIO_DIR), Weights & Biases offline (the run's .wandb file under
WANDB_DIR), MLflow (a local file store). One training run reports to all three; a test per tracker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from ..support.data import make_documents, tiny_recipe, write_jsonl
from ..support.trackers import mlflow_runs, tracker_env, trackio_metrics, wandb_metrics

TRACKERS = ["trackio", "wandb", "mlflow"]
PROJECT = "hftrain-trackers"
# What every tracker must hold: the Trainer's own values and hftrain's (step metrics, evaluation).
EXPECTED = ["loss", "learning_rate", "tokens_per_s", "mfu", "data_wait_frac", "eval_loss", "eval_bits_per_byte"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    for name in TRACKERS:
        pytest.importorskip(name)
    root = tmp_path_factory.mktemp("trackers")
    data = write_jsonl(root / "d.jsonl", make_documents(300))
    raw = tiny_recipe(
        data,
        root / "run",
        max_steps=12,
        save_steps=12,
        eval_strategy="steps",
        eval_steps=6,
        report_to=TRACKERS,
        run_name="tiny",
        project=PROJECT,
    )
    recipe = root / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env = {**os.environ, **tracker_env(root)}
    result = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", str(recipe)], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _check(metrics: dict[str, list[float]]) -> None:
    missing = [key for key in EXPECTED if not metrics.get(key)]
    assert not missing, (missing, sorted(metrics))
    assert len(metrics["loss"]) == 12 and metrics["loss"][-1] < metrics["loss"][0]
    assert len(metrics["eval_loss"]) == 3  # at steps 6 and 12, and the final model's (logged after training ended)
    assert all(v > 0 for v in metrics["tokens_per_s"]) and all(0 <= v <= 1 for v in metrics["data_wait_frac"])


@pytest.mark.slow
def test_trackio_holds_the_run(tracked):
    _check(trackio_metrics(tracked / "trackio", PROJECT))


@pytest.mark.slow
def test_wandb_offline_holds_the_run(tracked):
    _check(wandb_metrics(tracked / "wandb"))


@pytest.mark.slow
def test_mlflow_file_store_holds_the_run(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    runs = mlflow_runs(f"file:{tracked / 'mlruns'}")
    (training,) = runs.values()  # one run: the final evaluation lands in the training run, not a second one
    _check(training)


def test_mlflow_run_id_resumes_that_run_with_the_final_evaluation(tmp_path, make_recipe, monkeypatch):
    """MLFLOW_RUN_ID (transformers' documented way to report into an existing run, as a resumed job does): the
    training metrics and the final evaluation land in that run, which ends FINISHED; no second run. Before,
    hftrain's own run and the callback's both started it ("Run ... is already active") and nothing was reported."""
    mlflow = pytest.importorskip("mlflow")
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # not mlflow.set_tracking_uri: that one outlives the test and
    # overrides the variable for later tests in this process (transformers 5.17's callback then keeps it)
    with mlflow.start_run(run_name="earlier") as earlier:  # the job that ran before
        pass
    monkeypatch.setenv("MLFLOW_RUN_ID", earlier.info.run_id)
    from hftrain.training.run import train

    run = train(make_recipe(max_steps=3, save_steps=3, report_to=["mlflow"]))
    assert run.not_shared == []
    runs = mlflow_runs(uri)
    assert list(runs) == [earlier.info.run_id], runs
    assert len(runs[earlier.info.run_id]["loss"]) == 3 and len(runs[earlier.info.run_id]["eval_loss"]) == 1
    assert mlflow.tracking.MlflowClient(uri).get_run(earlier.info.run_id).info.status == "FINISHED"
