"""YAML reading with the number rules users expect.

PyYAML follows YAML 1.1, where ``3e-4`` is a *string* (a float needs a dot). Recipes and command-line
overrides are full of learning rates written that way, so the loader here reads them as floats.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4``/``5E3``-style scalars as floats."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - RecipeLoader is a SafeLoader


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
