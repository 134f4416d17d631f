"""`hftrain explain [SECTION]`: document every recipe key (or one section's), generated from the schema."""

from __future__ import annotations

import argparse
from typing import Any

from hftrain.recipe.docs import explain, recipe_sections

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("explain", help="document every recipe key (or one section's)")
    p.add_argument("section", nargs="?", choices=recipe_sections())
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    print(explain(args.section, brief_training=False))
    return 0
