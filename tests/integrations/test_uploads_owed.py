"""What a run owes to its outside services (issue 55, class 3): uploads go in order per service, a push that a newer
one rewrites is replaced rather than reported, the wait after the last step is one network bound per service,
a failure whose checkpoint rotation removed says so instead of naming it, and what waits survives a kill -9: the
next launch of the run sends it (the journal, outbox.JOURNAL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from hftrain import network
from hftrain.integrations import outbox as module
from hftrain.integrations.outbox import JOURNAL, OUTBOX_DIR, Outbox

from ..support.cli import in_process
from ..support.data import tiny_recipe
from ..support.hub_http import HubError

TOKEN = "hf_owedTESTtoken0123456789"


class Service:
    """A fake remote: what reached it, in order, and how often each upload was tried. It refuses the uploads named
    in `refuse` (each the number of times given, None: always) and holds every upload while `gate` is closed."""

    def __init__(self, refuse: dict[str, int | None] | None = None):
        self.refuse, self.landed, self.tries = dict(refuse or {}), [], {}
        self.gate = threading.Event()
        self.slow_s = 0.0  # how long a refusal takes

    def send(self, name: str):
        def attempt() -> str:
            self.gate.wait(30)
            self.tries[name] = self.tries.get(name, 0) + 1
            left = self.refuse.get(name, 0)
            if left is None or left > 0:
                self.refuse[name] = None if left is None else left - 1
                time.sleep(self.slow_s)
                raise ConnectionError(f"{name} refused")
            self.landed.append(name)
            return name

        return attempt


def _checkpoints(root: Path, *names: str) -> dict[str, Path]:
    made = {}
    for name in names:
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w")
        made[name] = folder
    return made


def _wait(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def replaced_in_one_place(outbox: Outbox, service: Service, folders: dict[str, Path]) -> None:
    """every_save: three pushes to the repo's root queue while the Hub is busy; only the newest is sent."""
    outbox.submit("the Hub", "hold", service.send("hold"))
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        staged = outbox.stage(folders[name])
        outbox.submit("the Hub", name, service.send(name), later=f"push {name}", staged=staged, target="me/m@main:/")
    service.gate.set()


def retried_keeps_its_place(outbox: Outbox, service: Service, folders: dict[str, Path]) -> None:
    """checkpoint-1's push fails once; the two queued after it wait for its second try (S3's copy does not)."""
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        outbox.submit("the Hub", name, service.send(name), later=f"push {name}")
    outbox.submit("S3", "s3-copy", service.send("s3-copy"))
    service.gate.set()
    _wait(lambda: len(service.landed) == 4)


def _three_refused(outbox: Outbox, service: Service, slow_s: float) -> None:
    service.slow_s = slow_s
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        outbox.submit("the Hub", name, service.send(name), later=f"push {name}")
    service.gate.set()
    _wait(lambda: any(u.tries == 1 for u in outbox._waiting))  # checkpoint-1 failed once, waits for its next try


def end_waits_once_per_service(outbox: Outbox, service: Service, folders: dict[str, Path]) -> None:
    """A Hub that answers too late (more than half the network bound) and fails: when training ends, the first
    waiting push is tried, the rest are not waited on."""
    _three_refused(outbox, service, slow_s=0.6)


def end_tries_each_after_a_quick_refusal(outbox: Outbox, service: Service, folders: dict[str, Path]) -> None:
    """A Hub that refuses at once (an HTTP error, not a silence): every waiting push is tried when training ends."""
    _three_refused(outbox, service, slow_s=0.0)


def rotated_away(outbox: Outbox, service: Service, folders: dict[str, Path]) -> None:
    """A copy that failed for good, and whose checkpoint rotation then removed: no command names the lost folder."""
    staged = outbox.stage(folders["checkpoint-1"])
    outbox.submit(
        "S3",
        "copying checkpoint-1",
        service.send("checkpoint-1"),
        "send it later: `hftrain push checkpoint-1`",
        staged,
        source=folders["checkpoint-1"],
    )
    service.gate.set()
    _wait(lambda: any(u.tries == 1 for u in outbox._waiting))
    for path in folders["checkpoint-1"].iterdir():
        path.unlink()
    folders["checkpoint-1"].rmdir()


# (case, refusals, what landed in order, {upload: tries}, [(what failed, its error starts with, its later)]); a
# failed upload is tried again after 0.2 s in the second case, 60 s in the others (not before training ends)
CASES = [
    (replaced_in_one_place, {}, ["hold", "checkpoint-3"], {"hold": 1, "checkpoint-3": 1}, []),
    (
        retried_keeps_its_place,
        {"checkpoint-1": 1},
        ["s3-copy", "checkpoint-1", "checkpoint-2", "checkpoint-3"],
        {"checkpoint-1": 2, "checkpoint-2": 1, "checkpoint-3": 1, "s3-copy": 1},
        [],
    ),
    (
        end_waits_once_per_service,
        {"checkpoint-1": None, "checkpoint-2": None, "checkpoint-3": None},
        [],
        {"checkpoint-1": 2},
        [
            ("checkpoint-1", "ConnectionError: checkpoint-1 refused", "push checkpoint-1"),
            (
                "checkpoint-2",
                "not tried: the Hub failed just before (ConnectionError: checkpoint-1 refused)",
                "push checkpoint-2",
            ),
            (
                "checkpoint-3",
                "not tried: the Hub failed just before (ConnectionError: checkpoint-1 refused)",
                "push checkpoint-3",
            ),
        ],
    ),
    (
        end_tries_each_after_a_quick_refusal,
        {"checkpoint-1": None, "checkpoint-2": None, "checkpoint-3": None},
        [],
        {"checkpoint-1": 2, "checkpoint-2": 1, "checkpoint-3": 1},
        [(f"checkpoint-{n}", f"ConnectionError: checkpoint-{n} refused", f"push checkpoint-{n}") for n in (1, 2, 3)],
    ),
    (
        rotated_away,
        {"checkpoint-1": None},
        [],
        {"checkpoint-1": 2},
        [
            (
                "copying checkpoint-1",
                "ConnectionError: checkpoint-1 refused",
                "it cannot be sent later: checkpoint-1 was removed by checkpoint rotation (training.save_total_limit)",
            )
        ],
    ),
]


@pytest.mark.parametrize("case, refusals, landed, tries, failed", CASES, ids=[c[0].__name__ for c in CASES])
def test_uploads_go_in_order_and_a_service_down_costs_one_wait(
    tmp_path, monkeypatch, case, refusals, landed, tries, failed
):
    """Before: the three pushes to one place were all sent, or two dropped as failures when staged (exit 76); a
    retried push landed after the ones queued behind it (checkpoint-2 and -3 overwrote by an older checkpoint-1);
    each waiting push was tried in turn after the last step (a network bound each, for a silent service); a rotated
    checkpoint's failure gave a command naming a folder that no longer exists."""
    monkeypatch.setattr(module, "RETRY_AFTER_S", (0.2 if case is retried_keeps_its_place else 60.0, 60.0, 60.0))
    monkeypatch.setattr(network, "_bound", 1.0)  # faults.network_timeout_s
    service, outbox = Service(refusals), Outbox(tmp_path / "run")
    case(outbox, service, _checkpoints(tmp_path / "run", "checkpoint-1", "checkpoint-2", "checkpoint-3"))
    failures = outbox.finish()
    outbox.settle()
    assert service.landed == landed
    assert {k: v for k, v in service.tries.items() if k in tries} == tries and set(service.tries) <= {*tries, *landed}
    assert [(f.what, f.later) for f in failures] == [(what, later) for what, _, later in failed], failures
    assert all(f.error.startswith(error) for f, (_, error, _) in zip(failures, failed)), failures
    assert not (tmp_path / "run" / OUTBOX_DIR).exists()


def test_what_a_killed_launch_owed_waits_in_the_journal(tmp_path, monkeypatch):
    """A launch that dies with uploads waiting (no finish: as after kill -9) leaves them in the journal, with the
    staged copies they send; the next launch's outbox finds them (and removes only its own strays)."""
    monkeypatch.setattr(module, "RETRY_AFTER_S", (600.0, 600.0, 600.0))
    run = tmp_path / "run"
    folders = _checkpoints(run, "checkpoint-1", "checkpoint-2")
    service = Service({"checkpoint-1": None, "checkpoint-2": None})
    killed = Outbox(run)
    staged = killed.stage(folders["checkpoint-2"])
    killed.submit(
        "the Hub", "revision step1", service.send("checkpoint-1"), "later 1", record={"kind": "revision", "step": 1}
    )
    killed.submit(
        "S3",
        "copying checkpoint-2",
        service.send("checkpoint-2"),
        "later 2",
        staged,
        record={"kind": "s3", "url": "s3://b/c"},
    )
    (run / OUTBOX_DIR / "stray").mkdir()  # a copy half-staged when the launch died
    service.gate.set()
    _wait(lambda: len(service.tries) == 2)  # both tried once and waiting for their next try
    owed = json.loads((run / OUTBOX_DIR / JOURNAL).read_text())
    assert [(e["what"], e["kind"], e["staged"]) for e in owed] == [
        ("revision step1", "revision", None),
        ("copying checkpoint-2", "s3", staged.name),
    ]
    after = Outbox(run)  # the next launch
    assert after.earlier == owed and staged.is_dir() and not (run / OUTBOX_DIR / "stray").exists()
    assert "storage_options" not in json.dumps(owed) and "secret" not in json.dumps(owed)


def _hub_recipe(tmp_path: Path, corpus: Path, **extra) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    raw = tiny_recipe(corpus, run_dir, max_steps=6, save_steps=2, save_total_limit=1, eval_strategy="no", **extra)
    raw["training"].update(push_to_hub=True, hub_model_id="tester/owed")
    raw["faults"] = {"network_timeout_s": 2}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return recipe, run_dir


def test_a_hub_that_answers_500_and_recovers_ends_the_run_with_everything_sent(
    tmp_path, corpus, local_hub, monkeypatch, capsys
):
    """hub_strategy every_save while the Hub answers 500 until the last checkpoint is written: the pushes that
    failed are replaced by newer ones (nothing reported), main gets them in order, the run exits 0 with
    not_shared empty. Before: checkpoint-2's push, dropped from the queue, was a failed service: exit 76, and its
    "send it later" named a checkpoint rotation had deleted."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    recipe, run_dir = _hub_recipe(tmp_path, corpus, hub_strategy="every_save")
    handle = local_hub._handle

    def outage_then_recovery(request):
        if not (run_dir / "checkpoint-6" / "hftrain_complete.json").is_file():
            raise HubError(500, "Internal Server Error")
        return handle(request)

    monkeypatch.setattr(local_hub, "_handle", outage_then_recovery)
    code, printed = in_process(capsys, "train", str(recipe))
    assert code == 0, printed[-3000:]
    # said as it happened
    assert "pushing checkpoint-2 to tester/owed failed" in printed and "training goes on" in printed
    assert (
        "replaces pushing checkpoint-2 to tester/owed in the queue" in printed
        or "replaces pushing checkpoint-4" in printed
    )
    results = json.loads((run_dir / "results.json").read_text())
    assert results.get("not_shared", []) == []
    repo = local_hub.repo("tester/owed")
    titles, commit = [], repo.resolve("main")
    while commit.parents:
        titles.append(commit.title)
        commit = repo.commits[commit.parents[0]]
    assert titles[::-1] == ["hftrain: checkpoint-6", "hftrain: final model"], titles
    assert not (run_dir / OUTBOX_DIR).exists()


# The kill waits until step 3's push is in the journal and step 1's first failure has been said: the push exports
# the checkpoint before its first try, which a busy machine finished after step 3 (the kill came before the line).
KILLED_AFTER_STEP_3 = """
import os, signal, sys, time
from hftrain.checkpoint import manager

class Said:
    def __init__(self, stream):
        self.stream, self.text = stream, []
    def write(self, text):
        self.text.append(text)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)

sys.stderr = said = Said(sys.stderr)
real = manager.CheckpointManager.save
def save(self, *args, **kwargs):
    result = real(self, *args, **kwargs)
    if (self.layout.root / "checkpoint-3" / "hftrain_complete.json").is_file():
        journal = self.layout.root / ".hftrain-outbox" / "pending.json"
        def ready():
            queued = journal.is_file() and "step3" in journal.read_text()
            return queued and "pushing checkpoint-1 as revision step1 of tester/owed failed" in "".join(said.text)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ready():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM kill, a lost node: no handler runs
    return result
manager.CheckpointManager.save = save
from hftrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_revisions_queued_before_a_kill_are_pushed_by_the_resumed_run(tmp_path, corpus, local_hub, monkeypatch, capsys):
    """Kept checkpoints pushed as revisions while the Hub refuses connections, then kill -9: the run resumes, and
    its next launch pushes step1..step3 (before: never pushed, and nothing said; not_shared empty)."""
    recipe, run_dir = _hub_recipe(tmp_path, corpus, hub_strategy="end")
    raw = yaml.safe_load(recipe.read_text())
    raw["training"].update(save_steps=1, save_total_limit=1, max_steps=5)
    raw["checkpoints"] = {"steps": [1, 2, 3], "push_revisions": True}
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    # nothing listens there
    env = {**local_hub.subprocess_env(), "HF_TOKEN": TOKEN, "HF_ENDPOINT": "http://127.0.0.1:9"}
    died = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_STEP_3, "train", str(recipe)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-3000:]
    assert "pushing checkpoint-1 as revision step1 of tester/owed failed" in died.stderr
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, printed = in_process(capsys, "train", str(recipe))
    assert code == 0, printed[-3000:]
    assert "an earlier launch of this run queued 3 upload(s) it did not send: sending them now" in printed
    for step in (1, 2, 3):
        assert f"hftrain: pushed checkpoint-{step} to tester/owed as revision step{step}" in printed
    repo = local_hub.repo("tester/owed")
    assert {"step1", "step2", "step3", "main"} <= set(repo.branches)
    assert json.loads((run_dir / "results.json").read_text()).get("not_shared", []) == []
    assert not (run_dir / OUTBOX_DIR).exists()


def test_a_silent_s3_endpoint_costs_one_bound_per_copy(tmp_path, silent_server):
    """faults.network_timeout_s bounds a copy's first contact as a whole: s3fs bounds each request, and its makedirs
    alone is several (a silent endpoint held a copy about 4 bounds; with the end's final copy, a run waited 197 s
    after its last step at a bound of 20 s)."""
    from hftrain.errors import HftrainError
    from hftrain.integrations.hub import copy_to_fsspec

    folder = _checkpoints(tmp_path, "checkpoint-1")["checkpoint-1"]
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": silent_server.url}}
    network.configure(2.0)
    try:
        started = time.monotonic()
        with pytest.raises(
            HftrainError,
            match=r"reaching s3://bucket/m/checkpoint-1: no answer within 2 s \(faults.network_timeout_s\)",
        ):
            copy_to_fsspec(folder, "s3://bucket/m/checkpoint-1", options)
        assert time.monotonic() - started < 2 * 2.0  # one bound, and the thread's start (before: about 4 bounds)
    finally:
        network.configure()
