"""A launched process of a multi-process run ends after its exit handlers without tearing down its process group
(parallel/process_end.py: gloo's teardown can deadlock with the GIL held); any other process ends as usual."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ..support.cli import ROOT

SCRIPT = """
import atexit, sys
import torch.distributed as dist
from hftrain.cli import program

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)

class Witness:
    def __del__(self):
        print("finalized", flush=True)  # interpreter finalization ran: it would destroy the process group too

witness = Witness()
code = program({argv!r})
atexit.register(lambda: print("a later exit handler ran", flush=True))
sys.exit(code)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_process_runs_its_exit_handlers_then_ends_without_teardown(launched):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    if launched:
        env["LOCAL_RANK"] = "0"  # as torchrun starts each process
    said = {}
    for argv, code in ((["presets"], 0), (["train", "no/such/recipe.yaml"], 2))[: 2 if launched else 1]:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(port=free_port(), argv=argv)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert done.returncode == code, done.stderr[-2000:]  # the program's own exit code either way
        assert "a later exit handler ran" in done.stdout  # exit handlers (trackers, TensorBoard) still run
        said[code] = "finalized" in done.stdout
    assert said == ({0: False, 2: False} if launched else {0: True})  # launched: no teardown at all


@pytest.mark.slow(seconds=60)
def test_a_killed_launcher_takes_its_ranks_with_them_saving_where_they_stop(tmp_path, corpus):
    """Issue 63 class 1: kill -9 of `hftrain train --accelerate-config ddp --nproc 2` (an OOM kill of the launcher,
    a closed terminal) left both ranks training into the output directory, without its lock. Now each rank gets
    SIGTERM when its launcher ends (the kernel's parent-death signal): they stop together at a step, as on a
    preemption, with a checkpoint there; then the directory is free."""
    import signal
    import time

    import psutil
    import yaml

    from hftrain.checkpoint.output_lock import owning
    from hftrain.checkpoint.resume import complete_checkpoints

    from ..support.checks import train_log
    from ..support.data import tiny_recipe

    run_dir = tmp_path / "run"
    raw = tiny_recipe(corpus, run_dir, max_steps=2000, save_steps=1000, logging_steps=1)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    argv = ["train", str(tmp_path / "r.yaml"), "--accelerate-config", "ddp", "--nproc", "2"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hftrain", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").is_file() or not train_log(run_dir):  # the ranks are training
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.1)
    ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "hftrain" in " ".join(p.cmdline())]
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=120)
    for p in alive:
        p.kill()
    assert not alive, "the ranks outlived their launcher"
    saved = complete_checkpoints(run_dir)
    assert len(saved) == 1 and not (run_dir / "final").exists(), saved  # where they stopped, as on a preemption
    with owning(run_dir, "training.output_dir"):
        pass  # nobody writes there any more
