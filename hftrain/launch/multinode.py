"""Several nodes: the group one node's launch joins (NodeGroup), and the scripts that start every node
(`hftrain launch-script --kind torchrun|slurm`).

Each node runs `hftrain train RECIPE --accelerate-config NAME --nnodes N --node-rank R --head-node ADDR`: hftrain
starts its processes with accelerate's launcher (GPUs) or torchrun's (`--cpu` rehearsal), so the backend is the
config's, errors are said once, and the config name resolves on the node itself. The rendezvous is static: node R
holds global ranks R*G .. R*G+G-1 (with c10d, torchrun ignores the node rank and global rank 0 can land on any
node, whose local disk then holds what rank 0 writes), and waiting for the other nodes is bounded
(`--rendezvous-timeout`). The SLURM script forwards SIGUSR1/SIGTERM for preemption and requeues the job when
hftrain exits with PREEMPTED_EXIT_CODE after saving a checkpoint.

Elastic (`--nnodes MIN:MAX --max-restarts N`, the torchrun script rendered with `--min-nodes`): torchrun's c10d
rendezvous and its agents' restarts. When a process fails or a node is lost, every node left stops its processes
and starts them again, with the nodes there (MIN or more), up to N times; a node that starts later joins at the
next restart. Each start resumes from the last complete checkpoint with the global batch kept (elastic.py). Ranks
land on any node at each start, so this needs one training.output_dir every node mounts (node_disks.py refuses
node-local disks).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from hftrain.errors import HftrainError, Preempted
from hftrain.parallel.child_errors import ELASTIC_ENV

PREEMPTED_EXIT_CODE = Preempted.exit_code  # saved a checkpoint on a preemption signal; run again to continue

RENDEZVOUS_TIMEOUT_S = 300  # how long a node waits for the others to join before it stops with a message
LAST_CALL_S = 30  # elastic: once MIN nodes are there, how long the rendezvous waits for more (up to MAX)
LAST_CALL_ENV = "HFTRAIN_RDZV_LAST_CALL_S"
# torch's c10d rendezvous shares its agent's store with the processes; across elastic rounds that breaks: a node
# joining a running group waits for MASTER_ADDR in the new round's keys, which the old rank 0 never writes (seen
# with torch 2.13: the join timed out, both nodes stopped), and restart counts differ per agent (pytorch#135712).
# Off, each round's rank 0 holds a fresh store (launcher_store.connect joins it).
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class NodeGroup:
    """This node's place among `count` nodes; `head` is node 0's address, `port` its rendezvous port. Elastic when
    `min_count` is set (1 .. count): a c10d rendezvous of MIN..count nodes, the processes restarted up to
    `restarts` times, ranks placed by the rendezvous (`rank` is then not used)."""

    count: int = 1
    rank: int = 0
    head: str = "127.0.0.1"
    port: int = 29500
    timeout_s: int = RENDEZVOUS_TIMEOUT_S
    min_count: int = 0
    restarts: int = 0

    def __post_init__(self) -> None:
        if self.elastic:
            if not 1 <= self.min_count <= self.count:
                raise HftrainError(f"--nnodes {self.min_count}:{self.count}: give MIN:MAX with 1 <= MIN <= MAX.")
            if self.restarts < 1:
                raise HftrainError(
                    f"--nnodes {self.min_count}:{self.count} restarts the processes when a node is lost or "
                    "joins: give --max-restarts N (N >= 1), how many restarts the run may use."
                )
        elif not 0 <= self.rank < self.count:
            raise HftrainError(f"--node-rank {self.rank}: give 0 .. {self.count - 1} for --nnodes {self.count}.")

    @property
    def elastic(self) -> bool:
        return self.min_count > 0

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes: N, or MIN:MAX when elastic."""
        return f"{self.min_count}:{self.count}" if self.elastic else str(self.count)

    def rendezvous_conf(self) -> str:
        """torchrun's --rdzv_conf: the bound on waiting for the nodes (and, elastic, the wait for more than MIN)."""
        if not self.elastic:
            return f"timeout={self.timeout_s}"
        return f"join_timeout={self.timeout_s},last_call_timeout={os.environ.get(LAST_CALL_ENV, LAST_CALL_S)}"

    def elastic_env(self) -> dict[str, str]:
        """What the processes of an elastic launch are told (node_disks.py refuses node-local disks with it); torchrun's
        own options that accelerate launch does not take (--nnodes MIN:MAX, the c10d endpoint), as torchrun reads
        them from its PET_ environment, the way Kubeflow's training operator sets them."""
        if not self.elastic:
            return {}
        return {
            ELASTIC_ENV: self.nnodes,
            "PET_NNODES": self.nnodes,
            "PET_RDZV_ENDPOINT": f"{self.head}:{self.port}",
            "PET_RDZV_ID": "hftrain",
            SHARED_STORE_OFF: "1",
        }

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's options for this node (one node: a standalone rendezvous on a port torchrun picks itself)."""
        if self.elastic:
            return [
                "--nnodes",
                self.nnodes,
                "--nproc_per_node",
                str(nproc),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"{self.head}:{self.port}",
                "--rdzv_id",
                "hftrain",
                "--max_restarts",
                str(self.restarts),
                "--rdzv_conf",
                self.rendezvous_conf(),
            ]
        if self.count == 1:
            return ["--standalone", "--nproc_per_node", str(nproc)]
        return [
            "--nnodes",
            str(self.count),
            "--node_rank",
            str(self.rank),
            "--nproc_per_node",
            str(nproc),
            "--rdzv_backend",
            "static",
            "--master_addr",
            self.head,
            "--master_port",
            str(self.port),
            "--rdzv_conf",
            self.rendezvous_conf(),
        ]

    def accelerate_args(self, nproc: int) -> list[str]:
        """accelerate launch's options for this node; its --num_processes counts every node's processes. Elastic:
        accelerate takes a whole machine count only, so it launches this node's processes as one machine's with a
        c10d rendezvous, and torchrun takes MIN:MAX and the endpoint from elastic_env (its main process port is a
        free local one, unused by c10d: a busy one would make accelerate fall back to a standalone launch)."""
        if self.elastic:
            return [
                "--num_machines",
                "1",
                "--machine_rank",
                "0",
                "--num_processes",
                str(nproc),
                "--rdzv_backend",
                "c10d",
                "--max_restarts",
                str(self.restarts),
                "--rdzv_conf",
                self.rendezvous_conf(),
                "--main_process_port",
                str(_free_port()),
            ]
        if self.count == 1:
            return ["--num_processes", str(nproc)]
        # DeepSpeed: accelerate's default for several machines is DeepSpeed's own pdsh launcher (ssh from node 0 to the
        # hosts of a hostfile); "standard" is torchrun on each node, as the script starts it
        return [
            "--num_machines",
            str(self.count),
            "--machine_rank",
            str(self.rank),
            "--num_processes",
            str(self.count * nproc),
            "--main_process_ip",
            self.head,
            "--main_process_port",
            str(self.port),
            "--rdzv_backend",
            "static",
            "--rdzv_conf",
            self.rendezvous_conf(),
            "--deepspeed_multinode_launcher",
            "standard",
        ]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


_LAUNCH = (
    "hftrain train {recipe}{extra} \\\n"
    "    --accelerate-config {config} --nproc {gpus}{cpu} \\\n"
    '    {nodes} --head-node "$HEAD_NODE" --master-port "$MASTER_PORT"'
)
_STATIC_NODES = '--nnodes "$NNODES" --node-rank {rank}'
_ELASTIC_NODES = '--nnodes "$MIN_NODES:$NNODES" --max-restarts "$MAX_RESTARTS"'
_FIND = """if ! command -v hftrain >/dev/null 2>&1; then
  echo "$0: hftrain is not on the PATH here; activate the environment hftrain is installed in on this node" >&2; exit 2
fi"""

TORCHRUN = """#!/usr/bin/env bash
# {nodes} nodes x {gpus} {unit} ({world} processes) with the accelerate config {config_name}.
# Run this same script on every node, each with its own NODE_RANK (0 .. {last}) and HEAD_NODE, node 0's address:
#   NODE_RANK=0 HEAD_NODE=10.0.0.1 ./THIS_FILE     (on node 0)
#   NODE_RANK=1 HEAD_NODE=10.0.0.1 ./THIS_FILE     (on node 1) ...
# MASTER_PORT (default 29500) must be free on the head node; NNODES (default {nodes}) is how many nodes take part.
# Arguments go to `hftrain train` (recipe overrides such as training.output_dir=/local/disk/run, per node).
# A node waits at most {timeout} s for the others (then stops with a message).
set -euo pipefail
: "${{NODE_RANK:?set NODE_RANK to the index of this node, 0 .. {last}}}"
: "${{HEAD_NODE:?set HEAD_NODE to the address of node 0}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"
NNODES="${{NNODES:-{nodes}}}"
{find}
exec {launch}
"""

TORCHRUN_ELASTIC = """#!/usr/bin/env bash
# Elastic: {min_nodes} to {nodes} nodes x {gpus} {unit} with the accelerate config {config_name}
# (torchrun's c10d rendezvous).
# Run this same script on every node, each with HEAD_NODE, the address of the node that holds the rendezvous
# (it must stay up: the nodes left restart through it):
#   HEAD_NODE=10.0.0.1 ./THIS_FILE     (on every node; no NODE_RANK: the rendezvous places the ranks)
# When a process fails or a node is lost, every node left stops its processes and starts them again with the nodes
# there (at least MIN_NODES, default {min_nodes}), at most MAX_RESTARTS times (default {restarts}); a node started
# later joins at the next restart. Each start resumes from the last complete checkpoint, with the global batch kept.
# training.output_dir must be on storage every node mounts: each start may place the ranks on other nodes.
# MASTER_PORT (default 29500) must be free on the head node; NNODES (default {nodes}) is the most nodes taking part.
# Arguments go to `hftrain train` (recipe overrides such as training.max_steps=1000).
# The first start waits at most {timeout} s for MIN_NODES nodes (then stops with a message).
set -euo pipefail
: "${{HEAD_NODE:?set HEAD_NODE to the address of the node that holds the rendezvous}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"
NNODES="${{NNODES:-{nodes}}}"
MIN_NODES="${{MIN_NODES:-{min_nodes}}}"
MAX_RESTARTS="${{MAX_RESTARTS:-{restarts}}}"
{find}
exec {launch}
"""

SLURM = """#!/usr/bin/env bash
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpu_line}#SBATCH --cpus-per-task={cpus}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --output=%x-%j.out
# {nodes} nodes x {gpus} {unit} ({world} processes) with the accelerate config {config_name}.
# Submit with: sbatch THIS_FILE
# On preemption SLURM sends SIGUSR1; hftrain saves a checkpoint, exits {code}, and the job requeues itself
# and resumes from that checkpoint.
set -uo pipefail
export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT="${{MASTER_PORT:-29500}}" NNODES="$SLURM_NNODES"
{find}
srun --kill-on-bad-exit=1 bash -c '{launch}' &
child=$!
trap 'kill -USR1 $child 2>/dev/null' USR1 TERM
wait $child; status=$?
while kill -0 $child 2>/dev/null; do wait $child; status=$?; done
if [ "$status" -eq {code} ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $status
"""


ELASTIC_RESTARTS = 3  # the elastic script's MAX_RESTARTS unless told


def render(
    kind: str,
    nodes: int,
    gpus: int,
    recipe: str,
    config: str,
    overrides: list[str],
    cpu: bool = False,
    min_nodes: int = 0,
) -> str:
    """The script for `kind` (torchrun | slurm). `config`: a shipped config name (ddp, fsdp, zero3, ...), resolved on
    each node, or a path valid on every node; `cpu`: a CPU rehearsal (gloo processes, `hftrain train --cpu`);
    `min_nodes` (torchrun): an elastic script, MIN_NODES..NNODES nodes with torchrun's restarts."""
    recipe_args = " ".join(shlex.quote(a) for a in [recipe, *overrides])
    common = {"recipe": recipe_args, "config": shlex.quote(config), "gpus": gpus, "cpu": " --cpu" if cpu else ""}
    fields = {  # what every script says of itself (str.format leaves a template's unused ones aside)
        "nodes": nodes,
        "gpus": gpus,
        "unit": "CPU processes" if cpu else "GPUs",
        "world": nodes * gpus,
        "config_name": config,
        "timeout": RENDEZVOUS_TIMEOUT_S,
        "find": _FIND,
    }
    if min_nodes:
        _check_elastic(kind, min_nodes, nodes)
        launch = _LAUNCH.format(**common, extra=' "$@"', nodes=_ELASTIC_NODES)
        return TORCHRUN_ELASTIC.format(**fields, min_nodes=min_nodes, restarts=ELASTIC_RESTARTS, launch=launch)
    if kind == "torchrun":
        launch = _LAUNCH.format(**common, extra=' "$@"', nodes=_STATIC_NODES.format(rank='"$NODE_RANK"'))
        return TORCHRUN.format(**fields, last=nodes - 1, launch=launch)
    launch = _LAUNCH.format(**common, extra="", nodes=_STATIC_NODES.format(rank="$SLURM_NODEID"))
    return SLURM.format(
        **fields,
        job=Path(recipe).stem,
        cpus=(1 if cpu else 8) * gpus,
        gpu_line="" if cpu else f"#SBATCH --gpus-per-node={gpus}\n",
        code=PREEMPTED_EXIT_CODE,
        launch=launch.replace(" \\\n    ", " "),
    )


def _check_elastic(kind: str, min_nodes: int, nodes: int) -> None:
    """--min-nodes: an elastic torchrun script of at least 1 and at most --nodes nodes."""
    if kind != "torchrun":
        raise HftrainError(
            "--min-nodes: elastic restarts are for the torchrun script; a SLURM job is restarted by SLURM "
            "(the script requeues itself after a preemption, on a fresh allocation of --nodes)."
        )
    if not 1 <= min_nodes <= nodes:
        raise HftrainError(f"--min-nodes {min_nodes}: give 1 .. {nodes} (--nodes {nodes} is the most nodes).")
