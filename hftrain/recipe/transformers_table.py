"""What the recipe schema reads from transformers (TrainingArguments' fields, the tracker names), as a table kept
per installed transformers, so that reading or refusing a recipe never imports the Trainer stack.

Importing TrainingArguments imports transformers.trainer_utils, and with it peft and bitsandbytes: 4-5 s on 2 cores
against 1.3 s for torch (issue 54). The table is read from transformers itself the first time a machine needs it
(one import), then kept in hftrain's cache (hftrain/_cache.py) under the installed transformers' version and the
size and time of the two files it comes from, so an upgrade, or an edited checkout of transformers, makes a new
one. Types travel as JSON (encode / decode): enums keep their names and values, a class no YAML can give keeps its
name and is left to TrainingArguments to check.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import json
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from hftrain import _cache

TABLE_VERSION = 2  # the table's own layout
SOURCES = ("training_args.py", "integrations/integration_utils.py")  # inside the transformers package


@dataclasses.dataclass(frozen=True)
class TrainingField:
    name: str
    annotation: Any
    default: Any
    help: str | None


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    """{"fields": [...], "trackers": [...]} for the installed transformers: kept, else read from it (then kept)."""
    name = f"transformers-table-{_stamp()}.json"
    kept = _cache.read_json(name)
    if isinstance(kept, dict) and kept.get("version") == TABLE_VERSION and isinstance(kept.get("fields"), list):
        return kept
    made = read_transformers()
    try:
        json.dumps(made)
    except (TypeError, ValueError):  # a default JSON cannot hold (none in transformers 5.17-5.24): used, not kept
        return made
    _cache.write_json(name, made)
    return made


def training_fields() -> list[TrainingField]:
    """TrainingArguments' init fields, with their types, defaults and help texts."""
    return [TrainingField(f["name"], decode(f["type"]), f["default"], f["help"]) for f in table()["fields"]]


def tracker_names() -> list[str]:
    """The report_to names transformers knows (its INTEGRATION_TO_CALLBACK)."""
    return list(table()["trackers"])


def read_transformers() -> dict[str, Any]:
    """The table, read from transformers itself (imports TrainingArguments: the seconds the table saves)."""
    from transformers import TrainingArguments
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    hints = typing.get_type_hints(TrainingArguments)
    fields = []
    for f in dataclasses.fields(TrainingArguments):
        if not f.init or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        default = default.value if isinstance(default, enum.Enum) else default
        fields.append(
            {"name": f.name, "type": encode(hints.get(f.name, Any)), "default": default, "help": f.metadata.get("help")}
        )
    return {"version": TABLE_VERSION, "fields": fields, "trackers": list(INTEGRATION_TO_CALLBACK)}


def _stamp() -> str:
    """The installed transformers, without importing it: its version and its source files' sizes and times."""
    spec = importlib.util.find_spec("transformers")
    root = Path(spec.origin).parent if spec and spec.origin else None
    parts: list[Any] = [metadata.version("transformers")]
    for name in SOURCES:
        try:
            stat = (root / name).stat() if root else None
            parts.append([stat.st_size, stat.st_mtime_ns] if stat else None)
        except OSError:
            parts.append(None)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


BUILTINS = {t.__name__: t for t in (bool, int, float, str, dict, list)}


def encode(annotation: Any) -> Any:
    """A field's type as JSON."""
    if annotation is type(None) or annotation is None:
        return "None"
    if annotation is Any:
        return "Any"
    if annotation in BUILTINS.values():
        return annotation.__name__
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": _named(annotation), "values": [member.value for member in annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return {"literal": list(args)}
    if origin in (list, dict) and args:
        return {origin.__name__: [encode(arg) for arg in args]}
    if origin in (typing.Union, types.UnionType):
        return {"union": [encode(arg) for arg in args]}
    if isinstance(annotation, type):  # a class no recipe file can give (accelerate's ParallelismConfig)
        return {"class": _named(annotation)}
    return "Any"


def decode(encoded: Any) -> Any:
    """A type from its JSON (encode's inverse; an enum is rebuilt with the same values)."""
    if isinstance(encoded, str):
        return {"None": type(None), "Any": Any, **BUILTINS}[encoded]
    if "enum" in encoded:
        return _enum(encoded["enum"], tuple(encoded["values"]))
    if "class" in encoded:
        return _unchecked(encoded["class"])
    if "literal" in encoded:
        return Literal[tuple(encoded["literal"])]  # type: ignore[valid-type]
    if "list" in encoded:
        return list[tuple(decode(arg) for arg in encoded["list"])]  # type: ignore[misc]
    if "dict" in encoded:
        return dict[tuple(decode(arg) for arg in encoded["dict"])]  # type: ignore[misc]
    return functools.reduce(lambda a, b: a | b, [decode(arg) for arg in encoded["union"]])


@functools.cache
def _enum(named: str, values: tuple[Any, ...]) -> type[enum.Enum]:
    """A str enum with transformers' values and name (a recipe gives the value; TrainingArguments takes it)."""
    module, _, name = named.rpartition(".")
    members = {f"V{i}": value for i, value in enumerate(values)}
    made = enum.Enum(name, members, type=str, module=module)  # type: ignore[call-overload]
    made.__qualname__ = name
    return made


@functools.cache
def _unchecked(named: str) -> type:
    """A class a recipe file cannot give, by its name: any value passes here, and TrainingArguments checks it."""
    from pydantic_core import core_schema

    module, _, name = named.rpartition(".")
    schema = classmethod(lambda cls, source, handler: core_schema.any_schema())
    return type(name, (), {"__module__": module, "__qualname__": name, "__get_pydantic_core_schema__": schema})


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
