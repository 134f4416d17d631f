"""`hftrain launch-script`: ready-to-run multi-node launch scripts (torchrun rendezvous, or SLURM sbatch).

Both start `accelerate launch` on every node with the chosen accelerate config, so the backend (DDP, FSDP,
ZeRO-3) is the config's. The SLURM script forwards SIGUSR1/SIGTERM for preemption and requeues the job when
hftrain exits with PREEMPTED_EXIT_CODE after saving a checkpoint.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from hftrain.errors import Preempted

PREEMPTED_EXIT_CODE = Preempted.exit_code  # saved a checkpoint on a preemption signal; run again to continue

_LAUNCH = (
    "accelerate launch --config_file {config} --num_machines {nodes} --num_processes {world} \\\n"
    "    --machine_rank {rank} --main_process_ip {head} --main_process_port {port} --rdzv_backend c10d \\\n"
    "    -m hftrain train {recipe}"
)

TORCHRUN = """#!/usr/bin/env bash
# {nodes} nodes x {gpus} GPUs ({world} processes) with {config_name}.
# Run this same script on every node, each with its own NODE_RANK (0 .. {last}); HEAD_NODE is node 0's address.
set -euo pipefail
: "${{NODE_RANK:?set NODE_RANK to the index of this node, 0 .. {last}}}"
HEAD_NODE="${{HEAD_NODE:-{head}}}"
exec {launch}
"""

SLURM = """#!/usr/bin/env bash
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --output=%x-%j.out
# {nodes} nodes x {gpus} GPUs ({world} processes) with {config_name}. Submit with: sbatch THIS_FILE
# On preemption SLURM sends SIGUSR1; hftrain saves a checkpoint, exits {code}, and the job requeues itself
# and resumes from that checkpoint.
set -uo pipefail
export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --kill-on-bad-exit=1 bash -c '{launch}' &
child=$!
trap 'kill -USR1 $child 2>/dev/null' USR1 TERM
wait $child; status=$?
while kill -0 $child 2>/dev/null; do wait $child; status=$?; done
if [ "$status" -eq {code} ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $status
"""


def render(kind: str, nodes: int, gpus: int, recipe: str, config: str, overrides: list[str], port: int = 29500) -> str:
    world = nodes * gpus
    recipe_args = " ".join(shlex.quote(a) for a in [recipe, *overrides])
    common = {"nodes": nodes, "gpus": gpus, "world": world, "config": shlex.quote(config), "port": port, "recipe": recipe_args}
    if kind == "torchrun":
        launch = _LAUNCH.format(**common, rank="$NODE_RANK", head='"$HEAD_NODE"')
        return TORCHRUN.format(nodes=nodes, gpus=gpus, world=world, last=nodes - 1, head="10.0.0.1",
                               config_name=Path(config).name, launch=launch)  # fmt: skip
    launch = _LAUNCH.format(**common, rank="$SLURM_NODEID", head="$HEAD_NODE").replace("\\\n    ", "")
    return SLURM.format(job=Path(recipe).stem, nodes=nodes, gpus=gpus, world=world, cpus=8 * gpus, code=PREEMPTED_EXIT_CODE,
                        config_name=Path(config).name, launch=launch)  # fmt: skip
