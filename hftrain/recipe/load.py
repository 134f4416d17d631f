"""Load a recipe: hftrain defaults < YAML file < overrides, validated, with every problem reported at once.

Overrides come from the command line as ``training.max_steps=50`` strings or from Python as nested dicts.
Validation errors name the dotted key, say what was expected and, for a mistyped key, the nearest valid one.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hftrain.errors import HftrainError
from hftrain.recipe.redaction import redact_value, redacted
from hftrain.recipe.schema import Recipe
from hftrain.recipe.training_section import TRAINING_DEFAULTS
from hftrain.recipe.yaml_io import load_yaml, read_recipe_file

P = TypeVar("P")


# ------------------------------------------------------------------------------------------- loading
def load_recipe(
    path: str | Path | None = None, overrides: list[str] | Mapping[str, Any] | None = None, **sections: Any
) -> Recipe:
    """Read, merge and validate a recipe.

    ``overrides`` is a list of ``dotted.key=value`` strings (the CLI form) or a nested dict; keyword arguments
    are per-section dicts (``training={"max_steps": 50}``), the notebook form. Raises HftrainError.
    """
    source = str(path) if path else "<defaults>"
    user: dict[str, Any] = read_recipe_file(Path(path)) if path is not None else {}
    if isinstance(overrides, Mapping):
        _deep_merge(user, copy.deepcopy(dict(overrides)))
    elif overrides:
        apply_overrides(user, overrides)
    if sections:
        _deep_merge(user, copy.deepcopy(sections))
    stem = Path(path).stem if path else "run"
    raw: dict[str, Any] = {"training": {**TRAINING_DEFAULTS, "output_dir": f"runs/{stem}"}}
    return validate_recipe(_deep_merge(raw, user), source)


def read_part(part: Callable[[Recipe], P], path: str | Path | None = None, **sections: Any) -> P:
    """One part of a saved recipe (a checkpoint's hftrain_recipe.yaml), or of the defaults with `sections`: what a
    component needs to read a checkpoint back, so that the whole recipe never reaches it (`part` is a Part's `of`)."""
    return part(load_recipe(path, None, **sections))


def read_sections(path: str | Path, *names: str) -> tuple[Any, ...]:
    """Sections of a saved recipe (a checkpoint's hftrain_recipe.yaml), validated with the whole: for a component
    that reads a section or two back, e.g. how the checkpoint's run fine-tuned (checkpoint/adapter.py)."""
    saved = load_recipe(path, None)
    return tuple(getattr(saved, name) for name in names)


def apply_overrides(tree: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to `tree`, left to right: the value (typed as YAML) replaces what
    stands at that key, whole (``data.train={path: x}`` replaces the recipe's data.train, it is not merged into
    it); a dotted key changes one field, so ``data.train.seq_len=...`` after ``data.train={...}`` edits the new
    value. A later override of the same key wins."""
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise HftrainError(f"override {item!r}: write it as section.key=value, e.g. training.max_steps=50")
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node, parts = tree, key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise HftrainError(
                    f"override {item!r}: {where} is a {type(child).__name__} here, not a section with keys; "
                    f"give it whole ({where}=...) instead of one of its keys"
                )
            node = child
        node[parts[-1]] = value
    return tree


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
    return base


# ---------------------------------------------------------------------------------------- validation
def validate_recipe(raw: dict[str, Any], source: str = "<recipe>") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        problems: dict[str, str] = {}
        for e in err.errors():
            path, text = _describe(e)
            problems.setdefault(path, text)  # a union reports once per member: keep the first
        listing = "\n".join(f"  - {p}" for p in problems.values())
        raise HftrainError(f"{source}: {len(problems)} problem(s) in the recipe:\n{listing}") from None


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop pydantic's union-member tags (e.g. 'str-enum[IntervalStrategy]') from an error location."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and i and part not in _field_names_at(loc[:i]) and _field_names_at(loc[:i]):
            return loc[:i]
        if isinstance(part, str) and i and not _field_names_at(loc[:i]) and _inner_model_at(loc[:i]) is None:
            return loc[:i]
    return loc


def _describe(error: Mapping[str, Any]) -> tuple[str, str]:
    loc = tuple(error["loc"])
    if error["type"] != "extra_forbidden":
        loc = _field_path(loc)
    path = _dotted(loc) or "recipe"
    if error["type"] == "extra_forbidden":
        siblings = _field_names_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), siblings, n=1, cutoff=0.6)
        hint = (
            f"did you mean {_dotted(loc[:-1] + (close[0],))}?" if close else f"valid keys here: {', '.join(siblings)}"
        )
        return path, f"{path}: unknown key; {hint}"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    got = error.get("input")
    if error["type"] not in ("missing", "value_error") and not isinstance(got, (dict, list)):
        message += f" (got {redact_value(path, got)!r})"
    return path, f"{path}: {message}"


def _inner_model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model found by walking ``loc`` down from Recipe (None past a leaf field)."""
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        model = inner_model(field.annotation) if field else None
    return model


def _field_names_at(loc: tuple[Any, ...]) -> list[str]:
    model = _inner_model_at(loc)
    return sorted(model.model_fields) if model else []


def inner_model(annotation: Any) -> type[BaseModel] | None:
    """The section model inside a field annotation (Optional[X], list[X], ...), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = inner_model(arg)
        if found:
            return found
    return None


# ------------------------------------------------------------------------------------- saving, hashing
def recipe_to_dict(recipe: Recipe, redact: bool = True) -> dict[str, Any]:
    """The resolved recipe as plain data (training: only the keys set), secrets removed unless redact=False."""
    data = recipe.model_dump(mode="json", exclude={"training"})
    data["training"] = json.loads(json.dumps(recipe.training_kwargs(), default=str))
    return redacted(data) if redact else data


# Keys that may change between the starts of one run without making it a different run.
_NOT_IDENTITY = {
    "model": {"attn_implementation", "trust_remote_code"},
    "tokenizer": {"trust_remote_code", "replace_model_tokenizer"},
    "data": {"eval_blocks", "on_bad_record", "readers", "record_batches"},  # what is read stays the same
}


def fingerprint(recipe: Recipe) -> dict[str, str]:
    """Short hashes of what defines a run's identity: model, tokenizer and data (not training settings). Only values
    other than their key's default count: a key a later hftrain adds (at a default that reads the data as before) does
    not make a run started before the upgrade another run's."""
    dumped = recipe.model_dump(mode="json", exclude_defaults=True)
    out = {}
    for part, ignored in _NOT_IDENTITY.items():
        kept = {k: v for k, v in dumped.get(part, {}).items() if k not in ignored}
        out[part] = hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]
    return out
