"""`hftrain launch-script RECIPE --kind torchrun|slurm`: write a multi-node launch script."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "launch-script"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="write a multi-node launch script (torchrun rendezvous or SLURM)")
    p.add_argument("recipe")
    p.add_argument("--kind", choices=["torchrun", "slurm"], default="slurm")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--accelerate-config", default="accelerate_configs/fsdp.yaml")
    p.add_argument("--out", help="write the script here (default: print it)")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from ..multinode import render
    script = render(args.kind, args.nodes, args.gpus_per_node, args.recipe, args.accelerate_config, overrides)
    if args.out:
        Path(args.out).write_text(script, encoding="utf-8")
        Path(args.out).chmod(0o755)
        print(f"wrote {args.out}")
    else:
        print(script)
    return 0
