"""Several nodes, rehearsed for real: the script `hftrain launch-script --kind torchrun --cpu` writes, run as two node
agents on 127.0.0.1 (each its own NODE_RANK, HEAD_NODE=127.0.0.1, MASTER_PORT, NNODES), against the same recipe on
one node with two processes; with one output directory for both, and with one per node (a node's own disk, as on
SageMaker instances or nodes without shared storage: checkpoint/node_disks.py). CPU gloo processes stand in for
GPUs; NCCL between machines is not rehearsed here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import json
import shutil

import yaml

from hftrain.checkpoint.layout import COMPLETE_MARKER

from ..support.checks import assert_resumed_matches, copy_checkpoint, metrics_losses
from ..support.cli import EXPECTED_TYPE, launch, run_cli
from ..support.data import make_documents, tiny_recipe, write_jsonl

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_agents(script: Path, port: int, ranks: tuple[int, ...] = (0, 1), nnodes: int = 2, timeout: float = 400,
                per_node: dict[int, list[str]] | None = None) -> list[tuple[int, str]]:  # fmt: skip
    """Run `script` once per node rank, at the same time, as a cluster's nodes would (`per_node`: a node's own
    arguments, such as its output directory); (exit code, stdout and stderr) of each."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HEAD_NODE": "127.0.0.1",
           "MASTER_PORT": str(port), "NNODES": str(nnodes)}  # fmt: skip
    agents = [subprocess.Popen(["bash", str(script), *(per_node or {}).get(r, [])], env={**env, "NODE_RANK": str(r)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ranks]  # fmt: skip
    deadline, outcomes = time.monotonic() + timeout, []
    for agent in agents:
        out, err = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
        outcomes.append((agent.returncode, out + err))
    return outcomes


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multinode")
    raw = tiny_recipe(write_jsonl(root / "docs.jsonl", make_documents(400)), root / "unused", max_steps=6, save_steps=3)
    raw["monitor"]["sample_max_new_tokens"] = 0
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def node_script(recipe_file: Path, backend: str, script: Path) -> Path:
    rendered = run_cli("launch-script", str(recipe_file), "--kind", "torchrun", "--nodes", "2", "--gpus-per-node", "1", "--cpu",
                       "--accelerate-config", backend, "--out", str(script))  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    return script


def train_on_nodes(script: Path, dirs: list[Path]) -> list[str]:
    """Both nodes train, node r into dirs[r] (one directory for both when they are the same); what each said."""
    outcomes = node_agents(script, free_port(), per_node={r: [f"training.output_dir={d}"] for r, d in enumerate(dirs)})
    assert [code for code, _ in outcomes] == [0, 0], "\n".join(err[-3000:] for _, err in outcomes)
    return [err for _, err in outcomes]


@pytest.mark.parametrize("backend, own_disks", [("ddp", False), ("fsdp", True), ("zero3", True)])
def test_two_node_agents_train_like_two_processes_on_one_node(tmp_path, recipe_file, backend, own_disks):
    """Part 1: the same per-step losses as 2 processes on one node. Part 2 (own disks): every node holds every
    checkpoint whole, its marker naming its own part of the merged record; a resume in which each node restores
    its own directory continues exactly, and a checkpoint complete on node 0 alone is not picked on either node."""
    one_node = tmp_path / "one-node"
    launch(recipe_file, backend, one_node)
    script = node_script(recipe_file, backend, tmp_path / "nodes.sh")
    dirs = [tmp_path / "node0", tmp_path / "node1"] if own_disks else [tmp_path / "shared"] * 2
    said = train_on_nodes(script, dirs)
    results = json.loads((dirs[0] / "results.json").read_text())
    assert (results["distributed_type"], results["world_size"]) == (EXPECTED_TYPE[backend], 2)
    a, b = metrics_losses(one_node), metrics_losses(dirs[0])
    assert sorted(a) == sorted(b) == list(range(1, 7))
    worst = max(abs(a[s] - b[s]) for s in a)
    print(f"{backend}: per-step loss difference, 2 nodes x 1 vs 1 node x 2: max {worst:.2e}")
    assert worst < 1e-5, (a, b)
    assert ("each node's own disk" in said[0]) is own_disks
    if not own_disks:
        return
    for node, directory in enumerate(dirs):
        for step in (3, 6):
            marker = json.loads((directory / f"checkpoint-{step}" / COMPLETE_MARKER).read_text())
            assert marker["lister"] == f"node{node}" and sorted(marker["files"]) == ["node0", "node1"]
            assert set(marker["files"]["node0"]) == set(marker["files"]["node1"])  # each node holds the whole checkpoint
    resumed = [tmp_path / "resumed0", tmp_path / "resumed1"]
    for source, target in zip(dirs, resumed):
        copy_checkpoint(source, target, "checkpoint-3")
    shutil.copytree(dirs[0] / "checkpoint-6", resumed[0] / "checkpoint-6")  # complete on node 0 only (node 1 was killed first)
    said = train_on_nodes(script, resumed)
    assert "resuming from checkpoint-3, the newest one complete on every node" in "".join(said)
    assert_resumed_matches(a, metrics_losses(resumed[0]), range(4, 7), backend)

