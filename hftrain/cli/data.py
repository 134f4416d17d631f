"""`hftrain data prepare|inspect RECIPE`: pre-tokenize a recipe's training data, or look at it (and check its packing)."""

from __future__ import annotations

import argparse
from typing import Any

from hftrain.cli.numbers import positive_float, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="prepare pre-tokenized shards, or inspect a recipe's data")
    sub = p.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser("prepare", help="tokenize and pack the training data once into shards + manifest")
    prep.add_argument("recipe")
    prep.add_argument("--out", required=True, help="directory or URL (s3://...) for the shards")
    prep.add_argument("--shard-size-mb", type=positive_float, default=1024.0, help="shard size (default 1024 MB)")
    prep.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokenize on N processes (default: every core); the shards are the same for any N",
    )
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
    from hftrain.data.prepare import inspect, prepare
    from hftrain.recipe.load import load_recipe
    from hftrain.recipe.parts import DataPrepPart, PackingCheckPart

    recipe = load_recipe(args.recipe, overrides)
    network.configure(recipe.faults.network_timeout_s)  # every network client from here on answers within this bound
    if args.data_command == "prepare":
        prepare(DataPrepPart.of(recipe), args.out, args.shard_size_mb, processes=args.processes)
    elif args.check_packing:
        from hftrain.data.packing_check import check_packing

        lines, ok = check_packing(PackingCheckPart.of(recipe))
        print("\n".join(lines), flush=True)
        return 0 if ok else 1
    else:
        print(inspect(DataPrepPart.of(recipe), args.blocks))
    return 0
