"""Every recipe key with its type, default and docstring: the text of `hftrain explain` and `train --help`.

Sections come from the schema itself (every field of ``Recipe`` that is a section model), so a new section
is documented, and accepted by `hftrain explain`, the moment it is added to schema.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from hftrain.errors import HftrainError
from hftrain.recipe.load import TRAINING_DEFAULTS, inner_model
from hftrain.recipe.schema import Recipe


def recipe_sections() -> list[str]:
    """The recipe's sections, in schema order."""
    return [name for name, info in Recipe.model_fields.items() if inner_model(info.annotation) is not None]


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("<class '", "").replace("'>", "")


def explain(section: str | None = None, brief_training: bool = True) -> str:
    """Every recipe key (or one section's) with its type, default and docstring."""
    sections = recipe_sections()
    if section is not None and section not in sections:
        raise HftrainError(f"explain: unknown section {section!r}; sections are {', '.join(sections)}")
    out: list[str] = []
    for name in [section] if section else sections:
        model = inner_model(Recipe.model_fields[name].annotation)
        assert model is not None
        out.append(f"{name}:  {Recipe.model_fields[name].description or ''}")
        if name == "training" and brief_training and section is None:
            out.append("  Any transformers.TrainingArguments field, with its own name and meaning. hftrain's defaults:")
            out += [f"    {k}: {v}" for k, v in TRAINING_DEFAULTS.items()]
            out.append("    output_dir: runs/<recipe file name>")
            out.append("  `hftrain explain training` lists every field.")
            continue
        out += _describe_fields(model, indent="  ")
    return "\n".join(out)


def _describe_fields(model: type[BaseModel], indent: str) -> list[str]:
    lines = []
    for key, info in model.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = "{...}"
        elif isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = "[...]"
        lines.append(f"{indent}{key}: {_type_name(info.annotation)} = {default!r}")
        doc = " ".join((info.description or "").split())
        if doc:
            lines.append(f"{indent}    {doc}")
        nested = inner_model(info.annotation)
        if nested is not None and nested is not model:
            lines += _describe_fields(nested, indent + "    ")
    return lines
