"""`hftrain data prepare|inspect|batch RECIPE`: pre-tokenize a recipe's training data, look at it (and check its
packing), or print the sequences any step trains on."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.cli.numbers import non_negative_float, non_negative_int, positive_int

if TYPE_CHECKING:
    from hftrain.data.loader import DataPlan
    from hftrain.data.step_batch import BatchLayout


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "data", help="prepare a token folder (on datatrove), inspect a recipe's data, or print a step's batch"
    )
    sub = p.add_subparsers(dest="data_command", required=True)
    add_prepare_parser(sub)
    insp = sub.add_parser("inspect", help="sources, shard counts, first blocks decoded, token estimate")
    insp.add_argument("recipe")
    insp.add_argument("--blocks", type=positive_int, default=2, help="how many blocks to decode (default 2)")
    insp.add_argument(
        "--check-packing",
        action="store_true",
        help="check that packed documents stay apart on every attention kernel here: each document's logits "
        "in the first packed micro-batch against the document run alone (exit 1 if any kernel leaks)",
    )
    add_batch_parser(sub)
    return p


def add_prepare_parser(sub: Any) -> None:
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


def add_batch_parser(sub: Any) -> None:
    batch = sub.add_parser(
        "batch",
        help="the sequences one step trains on, in training's order: a JSON object per sequence on standard output",
        description=(
            "Rebuilt from a recipe (as a launch of --processes x --workers would read it) or from a run directory "
            "(as that run read it). A stored-order Megatron corpus is read at the step at once; other sources are "
            "read from their start up to it."
        ),
    )
    batch.add_argument("target", metavar="RECIPE_OR_RUN", help="a recipe, or a run's training.output_dir")
    batch.add_argument(
        "--step", type=non_negative_int, required=True, metavar="N", help="the step, from the run's first (0)"
    )
    batch.add_argument("--decode", action="store_true", help="add each sequence's text")
    batch.add_argument(
        "--processes", type=positive_int, default=1, help="for a recipe: the launch's processes (default 1)"
    )
    batch.add_argument(
        "--workers", type=positive_int, default=1, help="for a recipe: dataloader workers per process (default 1)"
    )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain import network
    from hftrain.data.inspect import inspect
    from hftrain.data.part import DataPart
    from hftrain.data.prepare import prepare
    from hftrain.recipe.load import load_recipe

    if args.data_command == "batch":
        import sys

        from hftrain.data.step_batch import write_step

        plan, tokenizer, layout = step_source(args.target, overrides, args.processes, args.workers)
        count = write_step(sys.stdout, plan, tokenizer, layout, args.step, args.decode)
        first = args.step * layout.global_batch
        items = (
            f"; items {plan.first_row + first:,} to {plan.first_row + first + count - 1:,} of {plan.stored.prefix}, "
            f"corpus step {(plan.section.start_step or 0) + args.step:,}"
            if plan.stored is not None
            else ""
        )
        print(
            f"hftrain: step {args.step}: {count} sequences (global blocks {first:,} to {first + count - 1:,}; "
            f"{layout.readers} logical readers, shuffle window {layout.window}{items})",
            file=sys.stderr,
        )
        return 0
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


def step_source(
    target: str, overrides: list[str], processes: int = 1, workers: int = 1
) -> tuple[DataPlan, Any, BatchLayout]:
    """(data plan, tokenizer, layout) of a recipe as a launch of `processes` x `workers` would read it, or of a run
    directory as it read its data (its recorded layout, recipe and tokenizer)."""
    from hftrain import network
    from hftrain.data.inspect import scratch_tokenizer
    from hftrain.data.loader import plan_data
    from hftrain.data.step_batch import BatchLayout
    from hftrain.model.part import ModelPart
    from hftrain.parallel.batch import BatchPart, global_batch
    from hftrain.parallel.readers import decide_readers, decide_window
    from hftrain.recipe.load import load_recipe

    run = Path(target)
    if run.is_dir():
        recipe_file, recorded = _run_files(run)
        recipe = load_recipe(recipe_file, overrides)
    else:
        recipe, recorded = load_recipe(target, overrides), {}
    network.configure(recipe.faults.network_timeout_s)  # every network client from here on answers within it
    plan = plan_data(recipe.data, recipe.training.seed)
    batch = int(recorded.get("global_batch") or global_batch(BatchPart.of(recipe), processes))
    readers = decide_readers(recipe.data.readers, recorded.get("readers"), plan.reader_limit, processes, workers)
    window = decide_window(recipe.data.shuffle_window, recorded.get("shuffle_window"), readers, recipe.data.seq_len)
    if run.is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(recipe_file.parent))
    else:
        tokenizer = scratch_tokenizer(ModelPart.of(recipe), plan)
    return plan.starting_at(batch), tokenizer, BatchLayout(batch, readers, window)


def _run_files(run: Path) -> tuple[Path, dict[str, Any]]:
    """A run directory's recipe as it ran (its final model's, else its latest checkpoint's) and its start record."""
    import json

    from hftrain.checkpoint.layout import RECIPE_FILE, RunLayout, checkpoint_step
    from hftrain.errors import HftrainError

    layout = RunLayout(run)
    try:
        recorded = json.loads(layout.run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise HftrainError(
            f"{run}: not a run directory hftrain trained in (no readable {layout.run_file.name}); give a recipe, or "
            "the training.output_dir of a run."
        ) from None
    kept = sorted((p for p in run.glob("checkpoint-*") if checkpoint_step(p) is not None), key=checkpoint_step)
    for where in (layout.final, *reversed(kept)):
        if (where / RECIPE_FILE).is_file():
            return where / RECIPE_FILE, recorded
    raise HftrainError(f"{run}: holds no checkpoint or final model with its {RECIPE_FILE} yet; give the recipe.")
