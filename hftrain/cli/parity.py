"""`hftrain parity RECIPE`: the same run on single / DDP / FSDP / ZeRO-3, compared step by step; `--elastic`: a run
continued on another process count, per backend."""

from __future__ import annotations

import argparse
from typing import Any

from hftrain.cli.numbers import non_negative_float, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "parity", help="run a recipe on single / DDP / FSDP / ZeRO-3 (2 processes) and compare per step"
    )
    p.add_argument("recipe")
    p.add_argument("--steps", type=positive_int, default=20, help="optimizer steps per backend (default 20)")
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated subset of single,DDP,FSDP,ZeRO-3 (default: all; with --elastic: DDP,FSDP,ZeRO-3)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="instead: per backend, train on 2 and on 1 process with a checkpoint half-way, continue each on the other "
        "count, and compare (prints `elastic: max relative loss diff X, grad-norm diff Y`)",
    )
    p.add_argument(
        "--tolerance", type=non_negative_float, default=1e-4, help="exit 1 when a relative difference exceeds this"
    )
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    part = PlanPart.of(load_recipe(args.recipe, overrides))  # a bad recipe or key is refused before any run starts
    if args.elastic:
        from hftrain.launch.elastic_parity import elastic_parity

        return elastic_parity(
            args.recipe, overrides, part, args.steps, (args.backends or "DDP,FSDP,ZeRO-3").split(","), args.tolerance
        )
    from hftrain.launch.parity import parity

    return parity(
        args.recipe, overrides, part, args.steps, (args.backends or "single,DDP,FSDP,ZeRO-3").split(","), args.tolerance
    )
