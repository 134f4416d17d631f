"""`hftrain export CHECKPOINT --out DIR [--merge]`: any hftrain checkpoint -> one standard HF model directory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="consolidate a checkpoint (DDP, FSDP or ZeRO-3) into one standard HF model directory")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--merge", action="store_true", help="a LoRA checkpoint: merge the adapter into its base model")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.checkpoint.export import export

    print(f"exported: {export(Path(args.checkpoint), Path(args.out), merge=args.merge)}")
    return 0
