"""`hftrain parity RECIPE`: the same run on single / DDP / FSDP / ZeRO-3, compared step by step."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("parity", help="run a recipe on single / DDP / FSDP / ZeRO-3 (2 processes) and compare per step")
    p.add_argument("recipe")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per backend (default 20)")
    p.add_argument("--backends", default="single,DDP,FSDP,ZeRO-3", help="comma-separated subset of single,DDP,FSDP,ZeRO-3")
    p.add_argument("--tolerance", type=float, default=1e-4, help="exit 1 when a relative difference exceeds this")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from ..parity import parity

    return parity(args.recipe, overrides, args.steps, args.backends.split(","), args.tolerance)
