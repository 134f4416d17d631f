"""An outside service down never stops training (issue 45, class 1): the Hub, the S3 copy and a tracker all refuse
connections, and the run trains to its last step with every checkpoint, then exits 76 with one line per service,
each saying how to send it later. Through the CLI's own entry point, in this process."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
import yaml
from transformers import TrainerCallback, TrainerControl, TrainerState

from hftrain.integrations import trackers
from hftrain.integrations.outbox import STAGED_LIMIT, Outbox
from hftrain.integrations.trackers import QueuedReporter, TrackerQueue

from ..support.cli import in_process
from ..support.data import tiny_recipe
from ..support.trackers import mlflow_runs

TOKEN = "hf_downTESTtoken0123456789"
SECRET = "s3-secret-never-printed"


def closed_port() -> int:
    """A port nothing listens on: connections to it are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (service, the words of its line in the final message, the command its line gives)
SERVICES = [
    ("the Hub", "pushing the final model to tester/down failed", "`hftrain push {run} --repo-id tester/down`"),
    (
        "S3",
        "copying the final model to s3://bucket/models/final failed",
        "`hftrain push {run} --to s3://bucket/models/final`",
    ),
    ("mlflow", "starting the mlflow run and ", "failed (MlflowException: API request to"),  # the reports held behind it
    ("mlflow", "reports after it failed", "metrics.jsonl; send it later: `hftrain push {run} --report-to mlflow`"),
]


@pytest.fixture
def run_with_every_service_down(tmp_path, corpus):
    tmp = tmp_path
    port = closed_port()
    raw = tiny_recipe(corpus, tmp / "run", max_steps=6, save_steps=2, save_total_limit=1, report_to=["mlflow"])
    raw["training"].update(push_to_hub=True, hub_model_id="tester/down", hub_strategy="every_save")
    raw["hub"] = {
        "s3_uri": "s3://bucket/models",
        "storage_options": {
            "key": "k",
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
        },
    }
    raw["faults"] = {"network_timeout_s": 2}
    recipe = tmp / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return recipe, tmp / "run", port


def test_a_run_whose_hub_s3_and_tracker_are_down_trains_to_its_end(
    run_with_every_service_down, local_hub, monkeypatch, capsys
):
    recipe, run_dir, port = run_with_every_service_down
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    local_hub.stop()  # huggingface_hub points at it: connections refused
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    code, printed = in_process(capsys, "train", str(recipe))
    seconds = time.monotonic() - started
    assert code == 76, (code, printed[-4000:])  # before: exit 2 at the first save ("creating hub repo ... failed")
    assert "Traceback" not in printed and TOKEN not in printed and SECRET not in printed, printed[-4000:]
    # save_total_limit 1
    assert (run_dir / "checkpoint-6" / "hftrain_complete.json").is_file(), sorted(p.name for p in run_dir.iterdir())
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert not (run_dir / ".hftrain-outbox").exists()  # staged copies removed, sent or not
    results = json.loads((run_dir / "results.json").read_text())
    assert results["step"] == 6
    assert {f["service"] for f in results["not_shared"]} == {"the Hub", "S3", "mlflow"}
    final = printed[printed.index("hftrain: training finished and the model is saved in") :]
    assert "but 3 outside services failed" in final.splitlines()[0], final
    lines = {line.split(": ")[0].strip(): line for line in final.splitlines()[1:4]}
    for service, words, later in SERVICES:
        line = lines[service]
        assert words in line and later.format(run=run_dir) in line, (service, line)
    assert ".hftrain-outbox" not in printed  # messages name the checkpoint, not its staged copy
    # every failure was said when it happened, with training going on
    assert "hftrain: warning: copying checkpoint-2 to s3://bucket/models/checkpoint-2 failed (" in printed, printed[
        -4000:
    ]
    # the Hub's every_save pushes land in one place: a waiting one is replaced by the newer one, not reported
    assert re.search(r"hftrain: warning: pushing checkpoint-\d to tester/down failed \(.*training goes on", printed), (
        printed[-4000:]
    )
    assert "training goes on" in printed and "hftrain: warning: starting the mlflow run failed" in printed
    assert (
        "hftrain: warning: starting the mlflow run failed (MlflowException: API request to" in printed
        and "trying again in 30 s" in printed
    )
    assert "reporting to mlflow" not in printed  # the reports waited behind the run's start, none tried alone
    assert seconds < 120, seconds  # each service's failure costs its network bound (2 s here), never a stall
    # what the tracker missed is sent later by the command its line gives (here to a local MLflow store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{run_dir.parent / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    code, printed = in_process(capsys, "push", str(run_dir), "--report-to", "mlflow")
    assert code == 0 and "to mlflow" in printed, printed[-2000:]
    (metrics,) = mlflow_runs(f"file:{run_dir.parent / 'mlruns'}").values()
    assert len(metrics["loss"]) == 6 and len(metrics["eval_loss"]) == 1 and metrics["loss"][-1] < metrics["loss"][0]


def test_the_outbox_never_blocks_and_keeps_the_newest_staged_uploads(tmp_path, capsys):
    """A service that hangs: submit returns at once, staged uploads beyond STAGED_LIMIT drop the oldest (reported
    with its command), and the queued ones are sent in order once the service answers."""
    outbox = Outbox(tmp_path)
    release, sent = threading.Event(), []
    checkpoints = []
    for step in range(1, 6):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w" * 10)
        checkpoints.append(folder)
    outbox.submit("S3", "first", lambda: release.wait(30) and sent.append("first"))  # holds the worker
    started = time.monotonic()
    for folder in checkpoints:
        staged = outbox.stage(folder)
        outbox.submit(
            "S3",
            f"copying {folder.name}",
            lambda f=folder: sent.append(f.name),
            later=f"send it later: `push {folder.name}`",
            staged=staged,
        )
    assert time.monotonic() - started < 1  # nothing waited for the service
    assert [f.what for f in outbox.failures] == [f"copying checkpoint-{s}" for s in range(1, 6 - STAGED_LIMIT)]
    assert "send it later: `push checkpoint-1`" in capsys.readouterr().err
    release.set()
    assert [f.what for f in outbox.finish()] == [f"copying checkpoint-{s}" for s in range(1, 6 - STAGED_LIMIT)]
    assert sent == ["first", *[f"checkpoint-{s}" for s in range(6 - STAGED_LIMIT, 6)]]
    outbox.settle()  # the run's end is written
    assert not (tmp_path / ".hftrain-outbox").exists()
    # staging never moves the originals
    assert all((c / "model.safetensors").read_bytes() == b"w" * 10 for c in checkpoints)


def test_a_failed_upload_is_tried_again_while_training_goes_on(tmp_path, monkeypatch, capsys):
    """An outage heals itself: an upload that failed is tried again after a pause (not kept as a failure once it
    went through), past the schedule's last pause too (issue 63: one whose outage outlasted the schedule was reported
    failed though the service was back before the run ended); one that still fails when training ends is kept with
    its command, after one last try."""
    from hftrain.integrations import outbox as module

    monkeypatch.setattr(module, "RETRY_AFTER_S", (0.05, 0.05, 0.05))
    outbox, tries, sent = Outbox(tmp_path), {"flaky": 0, "healed": 0, "down": 0}, []

    def send(name: str, failures: int):
        def attempt():
            tries[name] += 1
            if tries[name] <= failures:
                raise ConnectionError(f"{name} refused")
            sent.append(name)

        return attempt

    outbox.submit("the Hub", "pushing flaky", send("flaky", 2), later="send it later: `push flaky`")
    outbox.submit("a tracker's server", "sending healed", send("healed", 1 + len(module.RETRY_AFTER_S)), later="x")
    outbox.submit("S3", "copying down", send("down", 99), later="send it later: `push down`")
    deadline = time.monotonic() + 30
    while (tries["down"] < 3 + len(module.RETRY_AFTER_S) or "healed" not in sent) and time.monotonic() < deadline:
        time.sleep(0.02)
    failures = outbox.finish()
    assert sent == ["flaky", "healed"] and tries["flaky"] == 3 and tries["healed"] == 2 + len(module.RETRY_AFTER_S)
    assert tries["down"] >= 4 + len(module.RETRY_AFTER_S)  # past the schedule while training, and once at its end
    assert [f.what for f in failures] == ["copying down"] and failures[0].later == "send it later: `push down`"
    said = capsys.readouterr().err
    assert (
        "hftrain: warning: pushing flaky failed (ConnectionError: "
        "flaky refused); trying again in 0 s; training goes on." in said
    )
    assert "pushing flaky failed (ConnectionError: flaky refused); send it later" not in said


class FlakyTracker(TrainerCallback):
    """A tracker whose server refuses the first `refusals` reports (`None`: every one), or holds each report until
    `release` is set."""

    def __init__(self, refusals: int | None = 0, release: threading.Event | None = None):
        self.refusals, self.release, self.seen = refusals, release, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.release is not None:
            self.release.wait(30)
        if self.refusals is None or self.refusals > 0:
            self.refusals = None if self.refusals is None else self.refusals - 1
            raise ConnectionError("tracker refused")
        self.seen.append((state.global_step, logs["loss"]))


def _report(reporter: QueuedReporter, steps: range) -> float:
    """The Trainer's on_log at each step, its dict reused as the Trainer may; the seconds it took."""
    state, control, logs = TrainerState(), TrainerControl(), {}
    started = time.monotonic()
    for step in steps:
        state.global_step, logs["loss"] = step, 10.0 - step
        reporter.on_log(None, state, control, logs=logs)
        reporter.on_step_end(None, state, control)  # the tracker does nothing there: nothing queued
    return time.monotonic() - started


def test_a_tracker_that_comes_back_gets_every_report_in_order(tmp_path, monkeypatch, capsys):
    """A tracker down for three tries: its reports wait in order behind the failed one, each pause of the schedule
    is said, and once it answers every report arrives with the step and values of its own moment; nothing is kept
    as a failure. One that never answers: what waited is one failure at the end, with its count."""
    monkeypatch.setattr(trackers, "RETRY_AFTER_S", (0.05, 0.05))
    outbox = Outbox(tmp_path)
    flaky, down = FlakyTracker(refusals=3), FlakyTracker(refusals=None)
    queues = [TrackerQueue("flaky", outbox), TrackerQueue("down", outbox)]
    assert _report(QueuedReporter(flaky, queues[0]), range(1, 6)) < 0.5
    assert _report(QueuedReporter(down, queues[1]), range(1, 5)) < 0.5
    deadline = time.monotonic() + 30
    while len(flaky.seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    for queue in queues:
        queue.close(time.monotonic() + 10)
    assert flaky.seen == [(step, 10.0 - step) for step in range(1, 6)]
    assert [(f.service, f.what, f.error) for f in outbox.failures] == [
        ("down", "reporting to down at step 1 and 3 reports after it", "ConnectionError: tracker refused")
    ]
    said = capsys.readouterr().err
    assert (
        said.count(
            "hftrain: warning: reporting to flaky at step 1 failed "
            "(ConnectionError: tracker refused); trying again in 0 s"
        )
        == 2
    )
    assert "(and every 10 min after)" in said and "hftrain: flaky answers again" in said


def test_a_tracker_that_hangs_never_holds_a_step_and_keeps_the_newest_reports(tmp_path, monkeypatch):
    """Past EVENT_LIMIT waiting reports the oldest metric report is dropped (the one in flight never is) and the
    count is one failure; the step never waited for the tracker."""
    monkeypatch.setattr(trackers, "EVENT_LIMIT", 3)
    outbox, release = Outbox(tmp_path), threading.Event()
    slow = FlakyTracker(release=release)
    queue = TrackerQueue("slow", outbox, later="send it later: `push`")
    assert _report(QueuedReporter(slow, queue), range(1, 11)) < 0.5
    release.set()
    queue.close(time.monotonic() + 10)
    assert slow.seen == [(1, 9.0), (9, 1.0), (10, 0.0)]
    assert [(f.what, f.later) for f in outbox.failures] == [("7 metric reports to slow", "send it later: `push`")]
