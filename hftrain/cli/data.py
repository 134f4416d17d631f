"""`hftrain data prepare|inspect RECIPE`: pre-tokenize a recipe's training data, or look at it (and check its
packing)."""

from __future__ import annotations

import argparse
from typing import Any

from hftrain.cli.numbers import non_negative_float, non_negative_int, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="prepare a token folder (on datatrove), or inspect a recipe's data")
    sub = p.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="tokenize the training data once, on datatrove, into a token folder (datatrove's tokenized layout)",
        description=(
            "Tasks of input files (--task-mb); the folder is the same for any executor, worker count or task split."
        ),
    )
    prep.add_argument("recipe")
    prep.add_argument("--out", required=True, help="directory or URL (s3://...) for the token folder")
    prep.add_argument(
        "--executor", choices=["local", "slurm", "ray"], default="local", help="where the tasks run (default: here)"
    )
    prep.add_argument(
        "--workers", type=positive_int, default=None, metavar="N", help="tasks at once (local default: every core)"
    )
    prep.add_argument(
        "--tasks",
        type=positive_int,
        default=None,
        metavar="N",
        help="run N of the tasks here (machines sharing one task space)",
    )
    prep.add_argument(
        "--task-offset",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="the first task this machine runs (default 0)",
    )
    prep.add_argument(
        "--task-mb",
        type=non_negative_float,
        default=None,
        metavar="MB",
        help="group input files into tasks of about MB (default 16; 0: one file per task); a file is never split",
    )
    prep.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep each file's documents in input order (default: shuffled, seeded by training.seed)",
    )
    slurm = prep.add_argument_group("--executor slurm")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default="24:00:00", help="time limit per task (default 24:00:00)")
    slurm.add_argument("--cpus-per-task", type=positive_int, default=1)
    slurm.add_argument("--mem-per-cpu-gb", type=positive_int, default=2)
    slurm.add_argument("--qos", default=None)
    insp = sub.add_parser("inspect", help="sources, shard counts, first blocks decoded, token estimate")
    insp.add_argument("recipe")
    insp.add_argument("--blocks", type=positive_int, default=2, help="how many blocks to decode (default 2)")
    insp.add_argument(
        "--check-packing",
        action="store_true",
        help="check that packed documents stay apart on every attention kernel here: each document's logits "
        "in the first packed micro-batch against the document run alone (exit 1 if any kernel leaks)",
    )
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain import network
    from hftrain.data.inspect import inspect
    from hftrain.data.prepare import prepare
    from hftrain.recipe.load import load_recipe
    from hftrain.recipe.parts import DataPart

    recipe = load_recipe(args.recipe, overrides)
    network.configure(recipe.faults.network_timeout_s)  # every network client from here on answers within this bound
    if args.data_command == "prepare":
        from hftrain.data.prepare import PrepareHow

        how = PrepareHow(
            executor=args.executor,
            workers=args.workers,
            tasks=args.tasks,
            task_offset=args.task_offset,
            partition=args.partition,
            time=args.time,
            cpus_per_task=args.cpus_per_task,
            mem_per_cpu_gb=args.mem_per_cpu_gb,
            qos=args.qos,
        )
        task_mb = {} if args.task_mb is None else {"task_mb": args.task_mb}
        prepare(DataPart.of(recipe), args.out, how, shuffle=not args.no_shuffle, **task_mb)
    elif args.check_packing:
        from hftrain.data.packing_check import check_packing

        lines, ok = check_packing(DataPart.of(recipe))
        print("\n".join(lines), flush=True)
        return 0 if ok else 1
    else:
        print(inspect(DataPart.of(recipe), args.blocks))
    return 0
