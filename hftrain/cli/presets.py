"""`hftrain presets`: the named model shapes (Pythia suite, NeoX-20B, small CPU shapes)."""

from __future__ import annotations

import argparse
from typing import Any

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return subparsers.add_parser("presets", help="list the named model shapes")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.recipe.presets import preset_table

    print(preset_table())
    return 0
