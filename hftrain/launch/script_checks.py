"""What `hftrain launch-script` checks before it writes a script of any kind (torchrun, slurm, sagemaker): a
script for a recipe that cannot run fails on every node, after the job waited for its nodes. The recipe loads
(its keys and values: the command loads it), the accelerate config is there and names a multi-process backend that
can run the recipe's finetune method, the data readers split over every process count the script may start, and an
elastic script's global batch splits over each of its node counts. SageMaker's own checks (files a job cannot read,
DeepSpeed) stay in sagemaker.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.errors import HftrainError

if TYPE_CHECKING:
    from hftrain.planning.part import PlanPart

PLAIN_DDP = ("none", "ddp")  # sagemaker: no config, SageMaker's torchrun runs plain DDP over every GPU


@dataclass(frozen=True)
class ScriptLaunch:
    """The launch a script starts: `per_node` processes on each of `nodes` (MIN `min_nodes` for an elastic
    script), or, where the script cannot know the processes per node (a SageMaker instance's GPUs), None."""

    kind: str  # torchrun | slurm | sagemaker
    config: str  # --accelerate-config: a shipped name or a path
    nodes: int
    per_node: int | None
    min_nodes: int = 0

    @property
    def elastic(self) -> bool:
        """An elastic torchrun script (a --min-nodes the script takes; multinode.render refuses the others)."""
        return self.kind == "torchrun" and 1 <= self.min_nodes <= self.nodes

    def node_counts(self) -> list[int]:
        return list(range(self.min_nodes if self.elastic else self.nodes, self.nodes + 1))

    def describe(self, nodes: int) -> str:
        if self.per_node is None:
            return f"the processes of --instance-count {nodes} (at least one per instance)"
        return f"the {nodes * self.per_node} processes of {nodes} node(s) x --gpus-per-node {self.per_node}"


def launch_config(name: str, kind: str) -> Path | None:
    """The accelerate config the script's processes run with, found as `hftrain train --accelerate-config` finds it
    on a node: a file or a shipped config's name. SageMaker: None for none or ddp (plain DDP), else found_here."""
    from hftrain.launch.processes import find_config

    if kind != "sagemaker":
        return find_config(name)
    return None if name.lower() in PLAIN_DDP else found_here(name)


def found_here(name: str) -> Path:
    """A config SageMaker's launcher translates on this machine (sagemaker.backend_environment): a file, a shipped
    config's name, or a path that names a shipped config (accelerate_configs/fsdp.yaml) from any directory."""
    from hftrain.launch.processes import find_config

    try:
        return find_config(name)
    except HftrainError as err:
        try:
            return find_config(Path(name).stem)
        except HftrainError:
            raise err from None


def check_script(part: PlanPart, launch: ScriptLaunch) -> None:
    """The recipe (loaded: its keys and values checked) against the launch the script starts, refused here in one
    line where its processes could not run it."""
    from hftrain.launch.processes import backend_of
    from hftrain.model.finetune import check_strategy
    from hftrain.parallel.batch import check_elastic_batch
    from hftrain.parallel.dims import Strategy

    config = launch_config(launch.config, launch.kind)
    check_strategy(part.model, Strategy.DDP if config is None else backend_of(config))
    workers = part.training_kwargs.get("dataloader_num_workers") or 0
    check_readers(part.data.readers, int(workers), launch)  # type: ignore[call-overload]
    if launch.elastic and launch.per_node:
        check_elastic_batch(part.batch, launch.min_nodes, launch.nodes, launch.per_node)


def check_readers(readers: int | None, workers: int, launch: ScriptLaunch) -> None:
    """data.readers (where the recipe fixes it; the default fits any launch) over processes x DataLoader workers."""
    if readers is None:
        return
    workers = max(workers, 1)
    for nodes in launch.node_counts():
        processes = nodes * (launch.per_node or 1)
        if readers % (processes * workers):
            each = f" x {workers} dataloader workers each (training.dataloader_num_workers)" if workers > 1 else ""
            per_gpu = "" if launch.per_node else " x the instance type's GPUs"
            raise HftrainError(
                f"data.readers: {readers} logical readers cannot be split over {launch.describe(nodes)}{each}; set "
                f"data.readers to a multiple of {processes * workers}{per_gpu}, "
                "or remove it (the default splits over any launch)."
            )
