"""Elastic launches (issue 29, part 3): what `--nnodes MIN:MAX --max-restarts N` hands torchrun through either
launcher, the refusals, the run's store keys across restarts, the messages of a launch that restarts, and the
global batch. The run itself (a node lost and taken back) is tests/launch/test_multinode.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hftrain.cli import main
from hftrain.errors import HftrainError
from hftrain.launch import multinode
from hftrain.launch import processes as launch
from hftrain.launch.multinode import NodeGroup
from hftrain.parallel import child_errors, rehearsal
from hftrain.parallel.child_errors import ELASTIC_ENV, ChildError
from hftrain.recipe.load import load_recipe

ROOT = Path(__file__).parents[2]
ELASTIC = NodeGroup(2, 0, "10.0.0.1", 29511, 300, min_count=1, restarts=3)
TORCHRUN_ARGS = {"nnodes": "1:2", "rdzv_backend": "c10d", "rdzv_endpoint": "10.0.0.1:29511", "max_restarts": 3}


def captured_launch(monkeypatch, start) -> dict:
    """What torchrun's run() is given (its options, and the environment the processes would start with)."""
    import torch.distributed.run as torchrun

    seen: dict = {}

    def run(args):
        seen.update(args=vars(args).copy(), env=dict(os.environ))

    monkeypatch.setattr(torchrun, "run", run)
    assert start() == 0
    return seen


@pytest.mark.parametrize("config", ["ddp", "fsdp", "deepspeed_zero3"])
def test_accelerates_launcher_hands_torchrun_min_max_and_the_c10d_endpoint(monkeypatch, config):
    """accelerate launch takes a whole machine count only (it sets torchrun's nnodes to it): with it, a lost node
    would leave the others waiting for it. hftrain launches each node's processes as one machine's with a c10d
    rendezvous, and torchrun reads MIN:MAX and the endpoint from its PET_ environment."""
    config_file = ROOT / "hftrain" / "accelerate_configs" / f"{config}.yaml"
    seen = captured_launch(monkeypatch, lambda: launch.accelerate_processes(["r.yaml"], config_file, 2, ELASTIC))
    assert {k: seen["args"][k] for k in TORCHRUN_ARGS} == TORCHRUN_ARGS
    assert seen["args"]["nproc_per_node"] == "2" and not seen["args"]["standalone"]
    assert seen["env"][ELASTIC_ENV] == "1:2" and seen["env"][multinode.SHARED_STORE_OFF] == "1"
    static = captured_launch(
        monkeypatch, lambda: launch.accelerate_processes(["r.yaml"], config_file, 2, NodeGroup(2, 1, "10.0.0.1"))
    )
    assert (
        static["args"]["nnodes"] == "2"
        and static["args"]["rdzv_backend"] == "static"
        and ELASTIC_ENV not in static["env"]
    )


def test_the_cpu_rehearsal_hands_torchrun_the_same(monkeypatch):
    config = ROOT / "hftrain" / "accelerate_configs" / "ddp.yaml"
    seen = captured_launch(
        monkeypatch, lambda: rehearsal.launch_processes(["train", "r.yaml"], config, "ddp", 1, ELASTIC)
    )
    assert {k: seen["args"][k] for k in TORCHRUN_ARGS} == TORCHRUN_ARGS
    assert seen["args"]["rdzv_conf"] == "join_timeout=300,last_call_timeout=30"
    assert seen["env"][ELASTIC_ENV] == "1:2" and seen["env"][multinode.SHARED_STORE_OFF] == "1"


def test_the_elastic_script_and_what_is_refused(tmp_path, capsys):
    script = multinode.render(
        "torchrun", 4, 8, "recipes/pretrain/pythia-1b.yaml", "fsdp", ["training.max_steps=100"], min_nodes=2
    )
    (tmp_path / "elastic.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "elastic.sh")]).returncode == 0
    assert (
        '--nnodes "$MIN_NODES:$NNODES" --max-restarts "$MAX_RESTARTS"' in script
        and "NODE_RANK" not in script.split("set -euo")[1]
    )
    assert (
        'MIN_NODES="${MIN_NODES:-2}"' in script
        and 'MAX_RESTARTS="${MAX_RESTARTS:-3}"' in script
        and "storage every node mounts" in script
    )
    with pytest.raises(HftrainError, match="--min-nodes: elastic restarts are for the torchrun script"):
        multinode.render("slurm", 4, 8, "r.yaml", "fsdp", [], min_nodes=2)
    with pytest.raises(HftrainError, match="--min-nodes 5: give 1 .. 4"):
        multinode.render("torchrun", 4, 8, "r.yaml", "fsdp", [], min_nodes=5)
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    cases = {
        ("--nnodes", "2:1"): "argument --nnodes: 2:1 cannot work: give MIN:MAX with MIN at most MAX",
        (
            "--nnodes",
            "1:2",
            "--accelerate-config",
            "ddp",
        ): "--nnodes 1:2 restarts the processes when a node is lost or joins: give --max-restarts N",
        (
            "--nnodes",
            "1:2",
            "--max-restarts",
            "2",
            "--node-rank",
            "1",
            "--accelerate-config",
            "ddp",
        ): "--node-rank 1: not with --nnodes 1:2",
    }
    for extra, message in cases.items():
        assert exit_code(["train", recipe, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's own refusal
        return int(stop.code)


def test_the_global_batch_of_an_elastic_run_is_max_nodes_and_must_split_over_min_to_max(monkeypatch):
    """A run whose first start had fewer nodes than MAX (they join within the rendezvous' last call, or not) would
    fix its global batch to that start's; then MAX nodes could not split it (seen: node 1 joined, both refused)."""
    from hftrain.parallel.batch import BatchPart, check_elastic_batch, derive_accumulation
    from hftrain.parallel.dims import LaunchEnv

    recipe = load_recipe(None, {"model": {"preset": "cpu-tiny"}, "training": {"per_device_train_batch_size": 8}})
    batch = BatchPart.of(recipe)
    monkeypatch.setenv(ELASTIC_ENV, "1:2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for processes, accumulation in ((1, 2), (2, 1)):  # 16 sequences: one node accumulates twice
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        assert derive_accumulation(batch, LaunchEnv.read(), announce=False) == accumulation
    monkeypatch.delenv(ELASTIC_ENV)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert derive_accumulation(batch, LaunchEnv.read(), announce=False) == 1  # not elastic: the recipe's own
    check_elastic_batch(batch, 1, 2, 1)
    with pytest.raises(HftrainError, match=r"cannot be split over 3 node\(s\) x 1 process\(es\).*e\.g\. 96"):
        check_elastic_batch(batch, 3, 4, 1)


def test_node_local_disks_are_refused_for_an_elastic_launch_and_save_on_each_node_false_for_any(monkeypatch, tmp_path):
    """An elastic start places ranks on any node and takes in nodes whose disks hold nothing; a recipe that keeps
    checkpoints on node 0 alone would lose them on the others. Both said before anything is written."""
    from types import SimpleNamespace

    from hftrain.checkpoint import node_disks

    dims = SimpleNamespace(nodes=2, rank=0, processes=2)
    monkeypatch.setattr(node_disks, "shared_output", lambda root, dims: False)
    kwargs: dict = {}
    assert node_disks.storage_settings(kwargs, tmp_path, dims) == {"save_on_each_node": True}  # a whole copy each
    assert kwargs == {}  # what it decides is returned, the values it read are left as they were
    with pytest.raises(HftrainError, match="training.save_on_each_node: false, but the 2 nodes do not share"):
        node_disks.storage_settings({"save_on_each_node": False}, tmp_path, dims)
    monkeypatch.setenv(ELASTIC_ENV, "1:2")
    with pytest.raises(HftrainError, match=r"this is an elastic launch \(--nnodes 1:2\).*without --min-nodes"):
        node_disks.storage_settings({}, tmp_path, dims)
    monkeypatch.setattr(node_disks, "shared_output", lambda root, dims: True)
    assert node_disks.storage_settings({}, tmp_path, dims) == {}  # one directory every node mounts: elastic is fine


def test_an_elastic_launch_says_what_its_processes_said_at_once_and_exits_0_after_restarts(
    tmp_path, monkeypatch, capfd
):
    """torchrun restarts the processes after a failure and returns normally once they finish: before, the message of
    the restarted attempt was printed only at the end, and decided the exit code (76 for a run that finished)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    lost = ChildError(0, 76, "lost rank 1 (node 1 of 2): ... torchrun restarts the processes on the nodes left")

    def restarted() -> None:
        child_errors.write_error(Path(os.environ[child_errors.ERROR_DIR_ENV]), lost)
        deadline, seen = time.monotonic() + 10, ""
        while not re.search(r"lost rank 1.*\n", seen):  # printed while the launch still runs (its line whole: print
            assert time.monotonic() < deadline  # writes the newline apart, and a read between them left it for later)
            time.sleep(0.1)
            seen += capfd.readouterr().err

    assert child_errors.launch(restarted, {ELASTIC_ENV: "1:2"}) == 0
    assert capfd.readouterr().err == ""  # said once, above

    def failed_for_good() -> None:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        for attempt in range(2):  # the same line from two attempts: printed once
            child_errors.write_error(Path(os.environ[child_errors.ERROR_DIR_ENV]), lost)
            time.sleep(1.2)
        raise ChildFailedError("hftrain", {0: ProcessFailure(0, 123, 76, "<N/A>")})

    assert child_errors.launch(failed_for_good, {ELASTIC_ENV: "1:2"}) == 76
    assert capfd.readouterr().err.count("hftrain: lost rank 1") == 1


AGREE = """
import json, os, sys, time
from hftrain.parallel import launcher_store
time.sleep(float(sys.argv[3]))
value = launcher_store.agree("speed", lambda: {"start": sys.argv[2]}, int(os.environ["RANK"]), 2)
open(os.path.join(sys.argv[1], f"{sys.argv[2]}-rank{os.environ['RANK']}.json"), "w").write(json.dumps(value))
"""


def test_a_restart_never_reads_what_an_earlier_start_left_in_the_store(tmp_path):
    """Two starts of a run in one store (torchrun's agent keeps it across restarts). At the second, node 1's agent
    counts 0 restarts (it joined later) where node 0's counts 1, and node 1's rank asks first. Keys named by the
    restart count (before) gave rank 1 the first start's decision: two ranks with different speed settings."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONPATH": str(ROOT),
    }

    def start(name: str, restarts: tuple[int, int], delays: tuple[float, float]) -> None:
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(tmp_path), name, str(delays[r])],
                env={**base, "RANK": str(r), "TORCHELASTIC_RESTART_COUNT": str(restarts[r])},
            )
            for r in (0, 1)
        ]
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]

    start("first", (0, 0), (0.0, 0.0))
    start("second", (1, 0), (1.5, 0.0))  # rank 0 decides late: rank 1 must wait for it, not read the first start's
    got = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*-rank*.json")}
    assert got == {
        "first-rank0": {"start": "first"},
        "first-rank1": {"start": "first"},
        "second-rank0": {"start": "second"},
        "second-rank1": {"start": "second"},
    }
