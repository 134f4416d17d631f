"""Several nodes, rehearsed for real: the script `hftrain launch-script --kind torchrun --cpu` writes, run as two node
agents on 127.0.0.1 (each its own NODE_RANK, HEAD_NODE=127.0.0.1, MASTER_PORT, NNODES), against the same recipe on
one node with two processes; with one output directory for both, and with one per node (a node's own disk, as on
SageMaker instances or nodes without shared storage: checkpoint/node_disks.py). CPU gloo processes stand in for
GPUs; NCCL between machines is not rehearsed here."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hftrain.checkpoint.layout import COMPLETE_MARKER

from ..support.checks import assert_resumed_matches, copy_checkpoint, metrics_losses
from ..support.cli import EXPECTED_TYPE, in_background, run_in_process
from ..support.reference_runs import SAVE, STEPS

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_agents(
    script: Path,
    port: int,
    ranks: tuple[int, ...] = (0, 1),
    nnodes: int = 2,
    timeout: float = 400,
    per_node: dict[int, list[str]] | None = None,
) -> list[tuple[int, str]]:
    """Run `script` once per node rank, at the same time, as a cluster's nodes would (`per_node`: a node's own
    arguments, such as its output directory); (exit code, stdout and stderr) of each."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HEAD_NODE": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NNODES": str(nnodes),
    }
    agents = [
        subprocess.Popen(
            ["bash", str(script), *(per_node or {}).get(r, [])],
            env={**env, "NODE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ranks
    ]
    # every agent's pipes read at once: one left unread fills its pipe (64 KB), blocks, and the others wait for it
    said = [in_background(lambda agent=agent: agent.communicate(timeout=timeout)) for agent in agents]
    outputs = ["".join(out.result()) for out in said]  # each agent has exited once its output is read to the end
    return [(agent.returncode, output) for agent, output in zip(agents, outputs)]


def node_script(recipe: Path, backend: str, script: Path) -> Path:
    rendered = run_in_process(
        "launch-script",
        str(recipe),
        "--kind",
        "torchrun",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--cpu",
        "--accelerate-config",
        backend,
        "--out",
        str(script),
    )
    assert rendered.returncode == 0, rendered.stderr
    return script


def train_on_nodes(script: Path, dirs: list[Path]) -> list[str]:
    """Both nodes train, node r into dirs[r] (one directory for both when they are the same); what each said."""
    outcomes = node_agents(script, free_port(), per_node={r: [f"training.output_dir={d}"] for r, d in enumerate(dirs)})
    assert [code for code, _ in outcomes] == [0, 0], "\n".join(err[-3000:] for _, err in outcomes)
    return [err for _, err in outcomes]


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_two_node_agents_on_their_own_disks_train_like_two_processes_on_one_node(
    tmp_path, sharded_yaml, backend_run, backend, request
):
    """Part 1: the same per-step losses as 2 processes on one node (the shared run of reference_runs.py; DDP, with one
    shared directory: the lost-node test below). Part 2: with a directory per node, every node holds every
    checkpoint whole, its marker naming its own part of the merged record; a resume in which each node restores
    its own directory continues exactly: FSDP's after a round trip through one S3 prefix (moto), ZeRO-3's with a
    checkpoint complete on node 0 alone, which is not picked on either node."""
    one_node = backend_run(backend, 2)
    script = node_script(sharded_yaml, backend, tmp_path / "nodes.sh")
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    said = train_on_nodes(script, dirs)
    results = json.loads((dirs[0] / "results.json").read_text())
    assert (results["distributed_type"], results["world_size"]) == (EXPECTED_TYPE[backend], 2)
    a, b = metrics_losses(one_node), metrics_losses(dirs[0])
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    worst = max(abs(a[s] - b[s]) for s in a)
    print(f"{backend}: per-step loss difference, 2 nodes x 1 vs 1 node x 2: max {worst:.2e}")
    assert worst < 1e-5, (a, b)
    assert "each node's own disk" in said[0]
    for node, directory in enumerate(dirs):
        for step in (SAVE, STEPS):
            marker = json.loads((directory / f"checkpoint-{step}" / COMPLETE_MARKER).read_text())
            assert marker["lister"] == f"node{node}" and sorted(marker["files"]) == ["node0", "node1"]
            assert marker["files"]["node0"] == marker["files"]["node1"]  # each node holds the same whole checkpoint
    resumed = [tmp_path / "resumed0", tmp_path / "resumed1"]
    for source, target in zip(dirs, resumed):
        copy_checkpoint(source, target, f"checkpoint-{SAVE}")
    if backend == "zero3":  # complete on node 0 only (node 1 was killed first)
        shutil.copytree(dirs[0] / f"checkpoint-{STEPS}", resumed[0] / f"checkpoint-{STEPS}")
    else:
        # as SageMaker's checkpoint_s3_uri: every instance uploads
        # its copy to one prefix, a restart downloads it on each
        through_one_s3_prefix(request.getfixturevalue("s3"), resumed)
    said = train_on_nodes(script, resumed)
    if backend == "zero3":
        assert f"resuming from checkpoint-{SAVE}, the newest one complete on every node" in "".join(said)
    assert_resumed_matches(a, metrics_losses(resumed[0]), range(SAVE + 1, STEPS + 1), backend)


def through_one_s3_prefix(s3, dirs: list[Path]) -> None:
    """Upload every node's directory to one S3 prefix (node 1's last, over node 0's), then replace each node's
    directory with that prefix's content, as SageMaker syncs /opt/ml/checkpoints of each instance."""
    import s3fs

    fs, prefix = s3fs.S3FileSystem(**s3.storage_options()), f"{s3.make_bucket()}/checkpoints"
    for directory in dirs:
        fs.put(str(directory) + "/", prefix, recursive=True)
    for directory in dirs:
        shutil.rmtree(directory)
        fs.get(prefix + "/", str(directory), recursive=True)
    assert (dirs[1] / f"checkpoint-{SAVE}" / COMPLETE_MARKER).is_file()


def start_two_nodes(
    script: Path, args: list[str], run_dir: Path, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Both node agents running `script ARGS`, once checkpoint-10 is complete in `run_dir` (training goes on)."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HEAD_NODE": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NNODES": "2",
        **(extra_env or {}),
    }
    agents = [
        subprocess.Popen(
            ["bash", str(script), *args],
            env={**env, "NODE_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoint-10" / COMPLETE_MARKER).is_file():
        assert time.monotonic() < deadline and agents[0].poll() is None, "no checkpoint-10"
        time.sleep(0.1)
    return agents


def survivor(agent: subprocess.Popen, since: float) -> tuple[float, list[str], str]:
    """How long node 0 took to stop after `since`, its "hftrain: lost" lines and its stderr."""
    _, err = agent.communicate(timeout=300)
    took = time.monotonic() - since
    lines = [line for line in err.splitlines() if line.startswith("hftrain: lost")]
    print(f"node 0 stopped {took:.1f} s after node 1 was lost: {lines}")
    assert agent.returncode == 76, (agent.returncode, err[-3000:])
    assert len(lines) == 1 and "lost rank 1 (node 1 of 2)" in lines[0], err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err
    return took, lines, err


def test_a_lost_node_is_named_and_the_run_continues_on_the_node_left(tmp_path, long_recipe, ddp_40_steps):
    """Parts 1 and 3, DDP with one directory for both nodes: until the kill, the per-step losses of 2 processes on
    one node. Then node 1's agent and its rank are killed (kill -9) in the middle of the run. Node 0 stops within a
    bound (gloo fails at once; liveness.py watches the beats for 4 s), one line naming rank 1 and node 1 and the
    checkpoint to continue from, exit 76. The same script started again with NNODES=1 continues from the last
    complete checkpoint on the one node left (1 process, the global batch kept) with the uninterrupted run's losses."""
    from hftrain.checkpoint.manager import complete_checkpoints

    from ..support.cli import kill_family

    run_dir = tmp_path / "run"
    script = node_script(long_recipe, "ddp", tmp_path / "nodes.sh")
    agents = start_two_nodes(script, [f"training.output_dir={run_dir}"], run_dir)
    kill_family(agents[1])
    took, lines, _ = survivor(agents[0], time.monotonic())
    last = complete_checkpoints(run_dir)[-1]
    assert took < 30 and f"the last complete checkpoint is {last}" in lines[0]
    [(code, said)] = node_agents(
        script, free_port(), ranks=(0,), nnodes=1, per_node={0: [f"training.output_dir={run_dir}"]}
    )
    assert code == 0, said[-3000:]
    resumed_at = int(last.name.split("-")[1])
    assert 10 <= resumed_at < 40 and json.loads((run_dir / "results.json").read_text())["world_size"] == 1
    assert_resumed_matches(ddp_40_steps, metrics_losses(run_dir), range(1, 41), "2 nodes, then NNODES=1")


def test_a_killed_node_agent_takes_its_rank_with_it(tmp_path, long_recipe):
    """Issue 63 class 1 on several nodes: kill -9 of node 1's agent (its launch script and torchrun, not its rank: an
    OOM kill of the agent, a lost ssh session) leaves no process of the run behind. Its rank gets the kernel's
    parent-death signal (SIGTERM, as a preemption), and both ranks stop together at a step with a complete checkpoint
    to continue from: node 0 says so in one line and exits 75, which a SLURM requeue takes."""
    import signal

    import psutil

    run_dir = tmp_path / "run"
    script = node_script(long_recipe, "ddp", tmp_path / "nodes.sh")
    agents = start_two_nodes(script, [f"training.output_dir={run_dir}"], run_dir)
    node1 = psutil.Process(agents[1].pid)
    family = [node1, *node1.children(recursive=True)]
    ranks = [p for p in family if "LOCAL_RANK" in p.environ()]
    assert len(ranks) == 1, [p.cmdline() for p in family]
    for process in family:
        if process not in ranks:
            process.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(ranks, timeout=120)
    for process in alive:
        process.kill()
    assert not alive, "node 1's rank outlived its agent"
    _, err = agents[0].communicate(timeout=300)
    agents[1].communicate(timeout=60)
    stopped = [line for line in err.splitlines() if line.startswith("hftrain: stopped by a signal to another rank")]
    assert agents[0].returncode == 75 and len(stopped) == 1, (agents[0].returncode, err[-3000:])  # as on preemption
    saved = re.search(r"saved (\S+checkpoint-\d+)\. Run the same command again", stopped[0])
    assert saved and (Path(saved[1]) / COMPLETE_MARKER).is_file(), stopped


def test_a_frozen_node_is_named_instead_of_a_hang(tmp_path, long_recipe):
    """A node that stops answering without dying (SIGSTOP: a hung machine) fails no collective: before, node 0
    waited in its all-reduce for the collective timeout. The watching heartbeat ends it after the peer timeout
    (5 s here, HFTRAIN_PEER_TIMEOUT_S; 120 s by default), with the same one line."""
    import signal

    import psutil

    run_dir = tmp_path / "run"
    script = node_script(long_recipe, "ddp", tmp_path / "nodes.sh")
    agents = start_two_nodes(script, [f"training.output_dir={run_dir}"], run_dir, {"HFTRAIN_PEER_TIMEOUT_S": "5"})
    family = [psutil.Process(agents[1].pid), *psutil.Process(agents[1].pid).children(recursive=True)]
    for process in family:
        process.send_signal(signal.SIGSTOP)
    try:
        took, lines, _ = survivor(agents[0], time.monotonic())
        assert "no beat for 5 s while training" in lines[0] and took < 30
    finally:
        for process in family:
            process.kill()
        agents[1].wait()


class Node:
    """One node agent running a script, its output read as it comes (`said`)."""

    def __init__(self, script: Path, env: dict[str, str], args: list[str]):
        import threading

        self.proc = subprocess.Popen(
            ["bash", str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
        )
        self.reader.start()

    @property
    def said(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 300) -> int:
        """Wait until `text` appears (after what was said before the call); the length said then."""
        deadline, start = time.monotonic() + timeout, len(self.said)
        while text not in self.said[start:]:
            assert time.monotonic() < deadline and self.proc.poll() is None, f"never said {text!r}: {self.said[-3000:]}"
            time.sleep(0.1)
        return len(self.said)

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        Path(os.environ.get("HFTRAIN_TEST_NODE_LOG", os.devnull)).open("a").write(f"=== exit {code}\n{self.said}")
        return code


def wait_listening(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"nothing listens on {port}"
        time.sleep(0.2)


def checkpoint_with(node: Node, other: Node, run_dir: Path, timeout: float = 300) -> Path:
    """The first checkpoint completed after `node` had a training process (it is in the group, not waiting to join)."""
    import psutil

    from hftrain.checkpoint.manager import complete_checkpoints

    deadline = time.monotonic() + timeout
    while not psutil.Process(node.proc.pid).children(recursive=True):
        assert time.monotonic() < deadline and other.proc.poll() is None, other.said[-3000:] + node.said[-3000:]
        time.sleep(0.1)
    time.sleep(1.0)  # its process has begun: the group restarts for it, or it was there from the start
    before = set(complete_checkpoints(run_dir))
    while not set(complete_checkpoints(run_dir)) - before:
        assert time.monotonic() < deadline and other.proc.poll() is None, other.said[-3000:] + node.said[-3000:]
        time.sleep(0.1)
    return sorted(set(complete_checkpoints(run_dir)) - before)[-1]


def test_an_elastic_launch_goes_on_without_a_lost_node_and_takes_it_back(tmp_path, long_recipe, ddp_40_steps):
    """Part 3, torchrun's own elastic restart: the script `launch-script --min-nodes 1` renders (c10d rendezvous,
    1 to 2 nodes, MAX_RESTARTS 3), one directory both nodes mount. Node 1's agent and rank are killed (kill -9)
    after checkpoint-10: node 0's rank names it and stops (exit 76), node 0's agent restarts it (alone, world 1 with
    the global batch kept by accumulation, unless node 1, started again at once, is back for that rendezvous); node 1
    joins at a restart (world 2). One run of 40
    steps with the uninterrupted run's losses at every step, node 0 never started again by hand.

    The restart of node 0 alone reads keys node 1's rank of the first start left in the store, and node 1's agent
    counts its restarts from 0 where node 0's counts 1: keys named by the restart count (before: launcher_store.py)
    were read stale or waited for in vain."""
    from ..support.cli import kill_family

    script = tmp_path / "elastic.sh"
    rendered = run_in_process(
        "launch-script",
        str(long_recipe),
        "--kind",
        "torchrun",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--cpu",
        "--accelerate-config",
        "ddp",
        "--min-nodes",
        "1",
        "--out",
        str(script),
    )
    assert rendered.returncode == 0, rendered.stderr
    run_dir, port = tmp_path / "run", free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HEAD_NODE": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HFTRAIN_RDZV_LAST_CALL_S": "10",
        "PYTHONUNBUFFERED": "1",
    }
    args = [f"training.output_dir={run_dir}"]
    first = Node(script, env, args)
    wait_listening(port)  # node 0's agent holds the rendezvous: it must be the node that stays
    second = Node(script, env, args)
    try:
        in_group = checkpoint_with(second, first, run_dir)  # node 1 may join at the first start or at a restart for it
        kill_family(second.proc)
        killed = time.monotonic()
        first.wait_for("torchrun restarts the processes on the nodes left (restart 1 of at most 3)")
        named = time.monotonic() - killed
        # node 1 again, started now: its launcher needs seconds of imports before its agent can join, and node 0,
        # once resumed alone, once finished the last steps and closed the rendezvous before a node started only
        # after "resuming" got there (CI of this session: node 1's agent then failed to reach the store)
        third = Node(script, env, args)
        first.wait_for("hftrain: resuming")
        print(
            f"elastic: node 1 named {named:.1f} s after the kill; node "
            f"0 resumed {time.monotonic() - killed:.1f} s after it"
        )
        assert first.finish() == 0 and third.finish() == 0, first.said[-3000:] + third.said[-3000:]
    finally:
        for node in (first, second):
            if node.proc.poll() is None:
                kill_family(node.proc)
    lost = [line for line in first.said.splitlines() if line.startswith("hftrain: lost")]
    assert len(lost) == 1 and "lost rank 1 (node 1 of 2)" in lost[0], first.said[-3000:]
    assert json.loads((run_dir / "results.json").read_text())["world_size"] == 2  # node 1 took part again
    losses = metrics_losses(run_dir)
    worst = max(abs(losses[step] - ddp_40_steps[step]) for step in range(1, 41))
    print(
        f"elastic: node 1 lost after {in_group.name}; {first.said.count('hftrain: resuming')} resumes on node 0; "
        f"per-step loss difference to the uninterrupted run: max {worst:.2e}; {lost[0]}"
    )
    assert_resumed_matches(ddp_40_steps, losses, range(1, 41), "elastic: 2 nodes, 1, then 2 again")


def test_a_node_whose_head_never_comes_says_so_in_one_line_and_exits_69(tmp_path, long_recipe):
    """Node 1 of 2 with nothing listening on the head node's port: after the rendezvous bound, hftrain's sentence and
    exit 69 (EX_UNAVAILABLE: a restart may reach the head node; docs/operations.md), without c10d's C++ error and
    retry lines and their 30-frame backtraces (before: both, twice, then the sentence, exit 1). The launched
    processes keep torch's C++ log level (the launcher's own is quieted before torch is imported)."""
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hftrain",
            "train",
            str(long_recipe),
            "--accelerate-config",
            "ddp",
            "--cpu",
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            str(free_port()),
            "--rendezvous-timeout",
            "3",
            f"training.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 69, said[-3000:]
    assert "hftrain: the nodes did not all join the rendezvous (The client socket has timed out after 3000ms" in said, (
        said[-3000:]
    )
    for noise in ("frame #", "socket.cpp", "TCPStore.cpp", "Traceback"):
        assert noise not in said, (noise, said[-3000:])
    assert time.monotonic() - started < 120
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


def test_launched_processes_keep_torchs_cpp_log_level(monkeypatch):
    from hftrain import _compat

    for name in ("TORCH_CPP_LOG_LEVEL", "HFTRAIN_CHILD_CPP_LOG_LEVEL", "LOCAL_RANK"):
        monkeypatch.setenv(name, "")  # recorded, so that what the calls below set is undone after the test
        monkeypatch.delenv(name)
    _compat.quiet_launcher_cpp_logs(["train", "r.yaml"])  # not a launcher: nothing changes
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ and _compat.launch_environment_cpp_logs() == {}
    _compat.quiet_launcher_cpp_logs(["train", "r.yaml", "--accelerate-config", "ddp"])
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "FATAL"
    assert _compat.launch_environment_cpp_logs() == {"TORCH_CPP_LOG_LEVEL": "WARNING"}  # torch's default, for the ranks
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # the user's own level stays everywhere
    monkeypatch.delenv("HFTRAIN_CHILD_CPP_LOG_LEVEL")
    _compat.quiet_launcher_cpp_logs(["train", "r.yaml", "--accelerate-config", "ddp"])
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO" and _compat.launch_environment_cpp_logs() == {}


def test_two_nodes_train_the_stored_rows_of_each_step(tmp_path):
    """Issue 64: a Megatron corpus in stored order (data.order: stored) on two node agents with one shared directory:
    what each node's process recorded it trained is, step for step, `hftrain data batch RUN --step k`, the corpus's
    items [8·(2 + k), 8·(2 + k + 1)) from data.start_step 2."""
    import numpy as np
    import yaml

    from hftrain.data.step_batch import read_consumed

    from ..data.test_megatron import stored_recipe
    from ..support.megatron import pythia_rows, rows_corpus

    prefix = tmp_path / "pile" / "document"
    rows_corpus(prefix, 8 * 8 + 4, 33, 255, shard_bytes=700)
    tokenizer = tmp_path / "tokenizer"
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw_tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    raw_tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw_tok, eos_token="t255").save_pretrained(tokenizer)
    recipe = stored_recipe(tmp_path, prefix, tokenizer, start_step=2, record_batches=True)
    raw = yaml.safe_load(recipe.read_text())
    raw["training"].update(max_steps=4, save_steps=4, per_device_train_batch_size=4)
    recipe.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    train_on_nodes(node_script(recipe, "ddp", tmp_path / "nodes.sh"), [run_dir, run_dir])
    seen = read_consumed(run_dir / "batches")
    assert sorted(seen) == list(range(32)) and len(list((run_dir / "batches").glob("rank-*.jsonl"))) == 2
    for step in range(4):
        printed = run_in_process("data", "batch", str(run_dir), "--step", str(step))
        rows = [json.loads(line) for line in printed.stdout.splitlines()]
        assert [r["sha256"] for r in rows] == [seen[g]["sha256"] for g in range(8 * step, 8 * step + 8)], step
        assert [seen[g]["item"] for g in range(8 * step, 8 * step + 8)] == list(range(8 * (2 + step), 8 * (3 + step)))
        assert np.array_equal(np.array([r["input_ids"] for r in rows]), pythia_rows(prefix, 2 + step, 8, 33))
