"""`hftrain plan RECIPE [--gpus N]`: the model's size, FLOPs and memory (per method, per strategy); trains nothing."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="print the model's size, FLOPs and memory; trains nothing")
    p.add_argument("recipe")
    p.add_argument("--gpus", type=int, help="also give per-GPU memory of each strategy on this many GPUs, and advice")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU for --gpus (default 80)")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.speed.estimates import format_plan, format_strategies, plan
    from hftrain.recipe.load import load_recipe

    recipe = load_recipe(args.recipe, overrides)
    info = plan(recipe)
    print(format_plan(info, str(recipe.model.from_pretrained or recipe.model.preset)))
    if args.gpus:
        print(format_strategies(info, args.gpus, args.gpu_mem_gb))
    return 0
