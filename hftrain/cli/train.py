"""`hftrain train RECIPE [key=value ...]`: train (and resume) a recipe, optionally in the processes of a backend."""

from __future__ import annotations

import argparse
import os
from typing import Any

from hftrain.cli.numbers import node_count, non_negative_int, positive_int


def _with_recipe_keys(parser: argparse.ArgumentParser) -> str:
    """`train --help` ends with every recipe key, generated from the schema (which imports transformers)."""
    from hftrain.recipe.docs import explain

    parser.epilog = "Recipe keys:\n\n" + explain()
    return argparse.ArgumentParser.format_help(parser)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a recipe (resumes an interrupted run in the same output_dir)",
        description=(
            "Train RECIPE. Overrides: section.key=value anywhere after the command, e.g. training.max_steps=50."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # the schema loads only for `train --help`
    p.format_help = lambda: _with_recipe_keys(p)  # type: ignore[method-assign]
    p.add_argument("recipe", help="recipe YAML file, e.g. recipes/quickstart.yaml")
    p.add_argument(
        "--accelerate-config",
        metavar="NAME_OR_PATH",
        help="start the processes of this accelerate config (shipped: ddp, fsdp, zero3, ...) and train in them",
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        help="processes to start with --accelerate-config (default: the config's; 2 on CPU)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="with --accelerate-config: rehearse the backend on CPU processes (gloo)"
    )
    p.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="after a crash, start again (resuming from the last complete checkpoint) up to N times "
        "(with --nnodes MIN:MAX: torchrun's restarts of every node's processes)",
    )
    nodes = p.add_argument_group("several nodes (with --accelerate-config; `hftrain launch-script` writes the script)")
    nodes.add_argument(
        "--nnodes",
        type=node_count,
        default=(0, 1),
        metavar="N|MIN:MAX",
        help="nodes taking part (default 1); MIN:MAX: elastic, torchrun's c10d rendezvous of MIN to MAX nodes "
        "that restarts every node's processes when a node is lost or joins (needs --max-restarts and one "
        "training.output_dir every node mounts)",
    )
    nodes.add_argument(
        "--node-rank", type=non_negative_int, default=0, help="this node's index, 0 .. NNODES-1 (not with MIN:MAX)"
    )
    nodes.add_argument("--head-node", default="127.0.0.1", metavar="ADDR", help="node 0's address (default 127.0.0.1)")
    nodes.add_argument(
        "--master-port", type=positive_int, default=29500, help="rendezvous port on the head node (default 29500)"
    )
    nodes.add_argument(
        "--rendezvous-timeout",
        type=positive_int,
        default=300,
        metavar="S",
        help="seconds to wait for the other nodes before stopping (default 300)",
    )
    return p


def node_group(args: argparse.Namespace) -> Any:
    """This node's NodeGroup; every node of one launch shares a run token, so their launchers join one output lock."""
    from hftrain.checkpoint.output_lock import RUN_TOKEN_ENV
    from hftrain.errors import HftrainError
    from hftrain.launch.multinode import NodeGroup

    least, count = args.nnodes
    if least and args.node_rank:
        raise HftrainError(
            f"--node-rank {args.node_rank}: not with --nnodes {least}:{count}, whose rendezvous places the ranks."
        )
    group = NodeGroup(
        count,
        0 if least else args.node_rank,
        args.head_node,
        args.master_port,
        args.rendezvous_timeout,
        least,
        args.max_restarts if least else 0,
    )
    if group.count > 1 or group.elastic:
        if not args.accelerate_config:
            raise HftrainError(
                "--nnodes: several nodes train with a multi-process backend; add --accelerate-config ddp|fsdp|zero3."
            )
        os.environ.setdefault(RUN_TOKEN_ENV, f"nodes@{group.head}:{group.port}")
    return group


def _without_option(argv: list[str], option: str) -> list[str]:
    """argv minus `option VALUE` / `option=VALUE`."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == option:
            skip = True
        elif not word.startswith(option + "="):
            out.append(word)
    return out


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain import network, progress
    from hftrain.launch.sagemaker_job import current_job
    from hftrain.recipe.load import load_recipe

    progress.start()  # a line at least every few seconds until the first step (progress.py)
    try:
        nodes = node_group(args)
        job = current_job()  # inside a SageMaker training job: its directories and channels (sagemaker_job.py)
        recipe = adapt(load_recipe(args.recipe, overrides), job)  # validated here, before any process is started
        # every network client from here on answers within this bound
        network.configure(recipe.faults.network_timeout_s)
        from hftrain.checkpoint.output_lock import owning

        with owning(recipe.training.output_dir, "training.output_dir"):  # the processes started below join it
            return _train(args, overrides, recipe, job, nodes)
    finally:
        progress.stop()  # however it ended (a refused recipe, in a notebook or a test, must not leave it talking)


def adapt(recipe: Any, job: Any) -> Any:
    """The recipe as it runs in a SageMaker `job` (launch/sagemaker_job.py: in_job), validated again; outside a job
    the recipe itself (a channel: path is then an error that says so)."""
    from hftrain.launch.sagemaker_job import in_job
    from hftrain.recipe.load import recipe_to_dict, validate_recipe

    raw = in_job(recipe_to_dict(recipe, redact=False), job)
    return recipe if raw is None else validate_recipe(raw, "<recipe in a SageMaker job>")


def _train(args: argparse.Namespace, overrides: list[str], recipe: Any, job: Any, nodes: Any) -> int:
    from hftrain import progress

    if args.max_restarts > 0 or args.accelerate_config:
        progress.stop()  # the processes started below speak for themselves
    if args.max_restarts > 0 and not nodes.elastic:  # elastic: torchrun's agents restart (multinode.py)
        from hftrain.launch.processes import supervise

        return supervise(_without_option(args.argv, "--max-restarts"), args.max_restarts)
    if args.accelerate_config:
        from hftrain.launch.processes import relaunch
        from hftrain.planning.part import PlanPart

        return relaunch(
            [args.recipe, *overrides], args.accelerate_config, args.nproc, args.cpu, PlanPart.of(recipe), nodes
        )
    from hftrain.parallel.process_end import leave_training
    from hftrain.training.run import train

    if job is None:
        run = train(recipe)
    else:
        from hftrain.launch.sagemaker_job import deliver, metric_lines_callback

        run = train(recipe, callbacks=[metric_lines_callback()])
        deliver(run, job)
    leave_training()  # the process group stays until the process ends (parallel/process_end.py)
    if run.not_shared:
        from hftrain.errors import NotShared
        from hftrain.integrations.outbox import not_shared_message

        raise NotShared(not_shared_message(run.not_shared, run.final_dir))
    return 0
