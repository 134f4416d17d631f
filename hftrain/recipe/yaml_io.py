"""YAML reading with the scalar rules users expect (YAML 1.2's, not PyYAML's YAML 1.1), and without its traps.

PyYAML follows YAML 1.1, where ``3e-4`` is a *string* (a float needs a dot) and ``no``/``yes``/``on``/``off``
are booleans. Recipes are full of learning rates written ``3e-4`` and of TrainingArguments values such as
``save_strategy: no``, so the loader reads ``3e-4`` as a float and only ``true``/``false`` as booleans.
A recipe file may not repeat a key (PyYAML keeps the last one silently), and aliases may not expand it past
MAX_EXPANDED_VALUES values (a "billion laughs" file is a few lines that expand to gigabytes).
`read_recipe_file` refuses a file that is wrong on its face (missing, not UTF-8, not YAML, not a mapping) without
the schema, so the command line says so before it imports torch and transformers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hftrain.errors import HftrainError


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


class StrictRecipeLoader(RecipeLoader):
    """RecipeLoader that refuses a key given twice in one mapping (recipe files; overrides may repeat keys)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {seen[key].line + 1}); keep one of them",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


MAX_EXPANDED_VALUES = 100_000


def load_yaml(text: str, strict: bool = False) -> Any:
    data = yaml.load(text, Loader=StrictRecipeLoader if strict else RecipeLoader)  # noqa: S506 - SafeLoader subclasses
    if expanded_size(data, {}) > MAX_EXPANDED_VALUES:
        raise yaml.YAMLError(f"aliases expand it to more than {MAX_EXPANDED_VALUES:,} values; write the values out")
    return data


def expanded_size(data: Any, memo: dict[int, int]) -> int:
    """How many values `data` holds once every alias is expanded (shared objects counted each time they appear),
    computed in time linear in the file: sizes of shared objects are remembered."""
    if not isinstance(data, (dict, list)):
        return 1
    if id(data) not in memo:
        children = list(data.keys()) + list(data.values()) if isinstance(data, dict) else data
        memo[id(data)] = 1 + sum(expanded_size(child, memo) for child in children)
    return memo[id(data)]


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def read_recipe_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HftrainError(
            f"{path}: recipe file not found. Shipped recipes live in recipes/ (try recipes/quickstart.yaml)."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HftrainError(f"{path}: not UTF-8 text (byte {err.start}); save the recipe as UTF-8.") from None
    try:
        data = load_yaml(text, strict=True)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise HftrainError(f"{path}:{where}: not valid YAML ({problem}). Fix the syntax there.") from None
    if data is None:
        raise HftrainError(
            f"{path}: the recipe is empty. A recipe is a mapping of sections, e.g.\n"
            "  model: {preset: pythia-14m}\n  training: {max_steps: 100}\n(see recipes/quickstart.yaml)"
        )
    if not isinstance(data, dict):
        raise HftrainError(
            f"{path}: a recipe must be a mapping of sections (model, tokenizer, data, training, monitor), got a "
            f"{type(data).__name__}."
        )
    return data
