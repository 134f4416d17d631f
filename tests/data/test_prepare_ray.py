"""Issue 63, class 1 on Ray: `hftrain data prepare --executor ray` stopped by Ctrl-C or SIGTERM ends at once with
its one line, and everything it started ends with it: the Ray cluster ray.init() started here (gcs_server, raylet,
the dashboard and its agents) and the workers running its tasks; the folder's lock is free for the same command.
Before: Ctrl-C waited for ever in datatrove's thread pool, holding the lock, while tasks went on; SIGTERM met Ray's
own handler, which aborted the process (exit 134) without a word. kill -9 needs nothing of hftrain: Ray starts its
daemons with the parent-death signal, and its workers end with their raylet."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hftrain.checkpoint.output_lock import owning

from ..support.data import tiny_recipe
from .test_token_folders import corpus, folder_digest, gpt2_recipe

pytestmark = pytest.mark.slow


def _corpus(root: Path, files: int = 6, mb: float = 3.0) -> Path:
    """Text whose tokenization takes seconds a task, so that the stop comes while tasks run, in more tasks than
    cores: those left wait for a CPU (where Ctrl-C used to hang)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    (root / "corpus").mkdir(parents=True)
    for i in range(files):
        lines, size = [], 0
        while size < mb * 2**20:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400)))}) + "\n"
            lines.append(line)
            size += len(line)
        (root / "corpus" / f"part-{i}.jsonl").write_text("".join(lines), encoding="utf-8")
    return root / "corpus"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell's background job starts with Ctrl-C ignored


def _ray_env() -> tuple[dict[str, str], str]:
    ray_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")  # Ray's sockets: a short path (AF_UNIX's 107 bytes)
    env = {**os.environ, "RAY_TMPDIR": ray_dir, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, started by the command
    return env, ray_dir


def test_a_ray_prepare_gives_the_folder_one_machine_gives(tmp_path):
    """The tasks on a Ray cluster the command starts (one per file here), the folder byte for byte the local one's."""
    from hftrain.data.part import DataPart
    from hftrain.data.prepare import PrepareHow, prepare
    from hftrain.recipe.load import load_recipe

    raw = gpt2_recipe(corpus(tmp_path, files=3, docs=600), tmp_path / "unused")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    here = prepare(DataPart.of(load_recipe(None, raw)), str(tmp_path / "here"), PrepareHow(workers=1), task_mb=0)
    env, ray_dir = _ray_env()
    try:
        command = [sys.executable, "-m", "hftrain", "data", "prepare", str(recipe), "--out", str(tmp_path / "ray")]
        done = subprocess.run(
            [*command, "--executor", "ray", "--task-mb", "0"], capture_output=True, text=True, env=env, timeout=300
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(3 of 3 task(s) run here" in done.stdout, done.stdout
    assert json.loads((tmp_path / "ray" / "prepared.json").read_text()) == here
    assert folder_digest(tmp_path / "ray") == folder_digest(tmp_path / "here")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_ray_prepare_ends_at_once_and_takes_its_cluster_with_it(stop, tmp_path):
    raw = tiny_recipe(_corpus(tmp_path), tmp_path / "unused")
    raw["tokenizer"] = {"builtin": "gpt2"}
    recipe, out = tmp_path / "r.yaml", tmp_path / "folder"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    env, ray_dir = _ray_env()
    command = [sys.executable, "-m", "hftrain", "data", "prepare", str(recipe), "--out", str(out)]
    command += ["--executor", "ray", "--task-mb", "0"]
    started = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=_default_sigint
    )
    ours: list[psutil.Process] = []
    try:
        prepare = psutil.Process(started.pid)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and started.poll() is None:  # until a worker runs a task
            ours = prepare.children(recursive=True)
            if any("RankWorker" in " ".join(_cmdline(p)) for p in ours):
                break
            time.sleep(0.2)
        assert started.poll() is None and ours, "the prepare ended before its tasks ran on Ray"
        time.sleep(3.0)  # tasks under way, the others waiting for a CPU
        ours = prepare.children(recursive=True)
        stopped_at = time.monotonic()
        started.send_signal(stop)
        printed, _ = started.communicate(timeout=60)
        took = time.monotonic() - stopped_at
        said = "hftrain: interrupted" if stop == signal.SIGINT else "hftrain: stopped by SIGTERM; the Ray job is ended."
        assert started.returncode == (130 if stop == signal.SIGINT else 143), printed[-3000:]  # as a shell says them
        assert said in printed.rstrip().splitlines()[-1] and "Traceback" not in printed, printed[-3000:]
        assert took < 20, took  # before: Ctrl-C never returned (seen 10 min), SIGTERM aborted in 3 s unsaid
        _, alive = psutil.wait_procs(ours, timeout=30)  # Ray's agents take a while: bounded here, never for ever
        assert not alive, [(p.pid, _cmdline(p)[:3]) for p in alive]
        assert not (out / "prepared.json").exists()
        with owning(str(out), "--out"):  # the lock is free for the same command
            pass
    finally:
        if started.poll() is None:
            started.kill()
        for process in ours:  # what a failed check left (reparented: no longer below the command)
            try:
                process.kill()
            except psutil.Error:
                pass
        shutil.rmtree(ray_dir, ignore_errors=True)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
