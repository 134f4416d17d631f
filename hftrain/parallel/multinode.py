"""Several nodes: the group one node's launch joins (NodeGroup), and the scripts that start every node
(`hftrain launch-script --kind torchrun|slurm`).

Each node runs `hftrain train RECIPE --accelerate-config NAME --nnodes N --node-rank R --head-node ADDR`: hftrain
starts its processes with accelerate's launcher (GPUs) or torchrun's (`--cpu` rehearsal), so the backend is the
config's, errors are said once, and the config name resolves on the node itself. The rendezvous is static: node R
holds global ranks R*G .. R*G+G-1 (with c10d, torchrun ignores the node rank and global rank 0 can land on any
node, whose local disk then holds what rank 0 writes), and waiting for the other nodes is bounded
(`--rendezvous-timeout`). The SLURM script forwards SIGUSR1/SIGTERM for preemption and requeues the job when
hftrain exits with PREEMPTED_EXIT_CODE after saving a checkpoint.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hftrain.errors import HftrainError, Preempted

PREEMPTED_EXIT_CODE = Preempted.exit_code  # saved a checkpoint on a preemption signal; run again to continue

RENDEZVOUS_TIMEOUT_S = 300  # how long a node waits for the others to join before it stops with a message


@dataclass(frozen=True)
class NodeGroup:
    """This node's place among `count` nodes; `head` is node 0's address, `port` its rendezvous port."""

    count: int = 1
    rank: int = 0
    head: str = "127.0.0.1"
    port: int = 29500
    timeout_s: int = RENDEZVOUS_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.count:
            raise HftrainError(f"--node-rank {self.rank}: give 0 .. {self.count - 1} for --nnodes {self.count}.")

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's options for this node (one node: a standalone rendezvous on a port torchrun picks itself)."""
        if self.count == 1:
            return ["--standalone", "--nproc_per_node", str(nproc)]
        return ["--nnodes", str(self.count), "--node_rank", str(self.rank), "--nproc_per_node", str(nproc), "--rdzv_backend", "static",
                "--master_addr", self.head, "--master_port", str(self.port), "--rdzv_conf", f"timeout={self.timeout_s}"]  # fmt: skip

    def accelerate_args(self, nproc: int) -> list[str]:
        """accelerate launch's options for this node; its --num_processes counts every node's processes."""
        if self.count == 1:
            return ["--num_processes", str(nproc)]
        return ["--num_machines", str(self.count), "--machine_rank", str(self.rank), "--num_processes", str(self.count * nproc),
                "--main_process_ip", self.head, "--main_process_port", str(self.port), "--rdzv_backend", "static",
                "--rdzv_conf", f"timeout={self.timeout_s}"]  # fmt: skip


_LAUNCH = (
    "hftrain train {recipe}{extra} \\\n"
    "    --accelerate-config {config} --nproc {gpus}{cpu} \\\n"
    '    --nnodes "$NNODES" --node-rank {rank} --head-node "$HEAD_NODE" --master-port "$MASTER_PORT"'
)
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

SLURM = """#!/usr/bin/env bash
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpu_line}#SBATCH --cpus-per-task={cpus}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --output=%x-%j.out
# {nodes} nodes x {gpus} {unit} ({world} processes) with the accelerate config {config_name}. Submit with: sbatch THIS_FILE
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


def render(kind: str, nodes: int, gpus: int, recipe: str, config: str, overrides: list[str], cpu: bool = False) -> str:
    """The script for `kind` (torchrun | slurm). `config`: a shipped config name (ddp, fsdp, zero3, ...), resolved on
    each node, or a path valid on every node; `cpu`: a CPU rehearsal (gloo processes, `hftrain train --cpu`)."""
    world = nodes * gpus
    recipe_args = " ".join(shlex.quote(a) for a in [recipe, *overrides])
    common = {"recipe": recipe_args, "config": shlex.quote(config), "gpus": gpus, "cpu": " --cpu" if cpu else ""}
    unit = "CPU processes" if cpu else "GPUs"
    if kind == "torchrun":
        launch = _LAUNCH.format(**common, extra=' "$@"', rank='"$NODE_RANK"')
        return TORCHRUN.format(nodes=nodes, gpus=gpus, unit=unit, world=world, last=nodes - 1, config_name=config,
                               timeout=RENDEZVOUS_TIMEOUT_S, find=_FIND, launch=launch)  # fmt: skip
    launch = _LAUNCH.format(**common, extra="", rank="$SLURM_NODEID").replace(" \\\n    ", " ")
    return SLURM.format(job=Path(recipe).stem, nodes=nodes, gpus=gpus, unit=unit, world=world, cpus=(1 if cpu else 8) * gpus,
                        gpu_line="" if cpu else f"#SBATCH --gpus-per-node={gpus}\n", code=PREEMPTED_EXIT_CODE,
                        config_name=config, find=_FIND, launch=launch)  # fmt: skip
