"""YAML reading with the scalar rules users expect (YAML 1.2's, not PyYAML's YAML 1.1).

PyYAML follows YAML 1.1, where ``3e-4`` is a *string* (a float needs a dot) and ``no``/``yes``/``on``/``off``
are booleans. Recipes are full of learning rates written ``3e-4`` and of TrainingArguments values such as
``save_strategy: no``, so the loader reads ``3e-4`` as a float and only ``true``/``false`` as booleans.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats and booleans."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


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
