"""`hftrain explain [SECTION]`: document every recipe key (or one section's), generated from the schema."""

from __future__ import annotations

import argparse
from typing import Any

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("explain", help="document every recipe key (or one section's)")
    p.add_argument("section", nargs="?", help="one section (model, data, training, ...): its keys alone")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.errors import HftrainError
    from hftrain.recipe.docs import explain, recipe_sections

    if args.section is not None and args.section not in recipe_sections():
        raise HftrainError(
            f"explain: {args.section!r} is not a recipe section; the sections: {', '.join(recipe_sections())}."
        )
    print(explain(args.section, brief_training=False))
    return 0
