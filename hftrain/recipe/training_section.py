"""The recipe's ``training`` section: generated from transformers' ``TrainingArguments``, so its keys, types
and help texts are exactly Hugging Face's (no hand-kept copy to drift), read through the table kept per installed
transformers (recipe/transformers_table.py)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from hftrain.recipe.transformers_table import training_fields

# hftrain's own training defaults: the lowest layer, below the YAML file (recipe/load.py). Chosen for small-to-medium
# pretraining; every one is a plain TrainingArguments key that a recipe may change.
TRAINING_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "learning_rate": 6e-4,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.05,
    "weight_decay": 0.1,
    "adam_beta2": 0.95,
    "max_grad_norm": 1.0,
    "logging_steps": 10,
    "save_steps": 100,
    "save_total_limit": 2,
    "report_to": ["tensorboard"],
    "seed": 1234,
    "disable_tqdm": False,
}

# Numbers TrainingArguments takes unchecked that fail later with a raw exception (a negative learning rate in the
# optimizer, a batch of 0 as a division by zero): refused when the recipe is read, naming the key.
BOUNDS: dict[str, dict[str, float]] = {
    "learning_rate": {"ge": 0},
    "per_device_train_batch_size": {"gt": 0},
    "per_device_eval_batch_size": {"gt": 0},
    "gradient_accumulation_steps": {"gt": 0},
    "weight_decay": {"ge": 0},
    "max_grad_norm": {"ge": 0},
    "warmup_steps": {"ge": 0},
    "save_total_limit": {"ge": 0},
    "num_train_epochs": {"ge": 0},
}


def _training_section() -> type[BaseModel]:
    """A pydantic model with exactly TrainingArguments' fields, types and help texts (from the installed
    transformers' table, recipe/transformers_table.py: reading a recipe does not import the Trainer stack)."""
    fields: dict[str, Any] = {}
    for f in training_fields():
        annotation = f.annotation
        if f.name == "resume_from_checkpoint":
            annotation = bool | str  # hftrain: true = latest complete checkpoint, false = never, or a path
        bounds = BOUNDS.get(f.name, {})
        fields[f.name] = (annotation | None, Field(default=f.default, description=f.help, **bounds))
    return create_model(
        "TrainingSection",
        __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_default=False),
        __doc__="Hugging Face TrainingArguments, with their own names and meanings.",
        __validators__={
            "_no_token": field_validator("hub_token")(_no_token_in_recipes),
            "_known_trackers": field_validator("report_to")(_known_trackers),
            "_no_bool_for_number": field_validator("*", mode="before")(bool_is_not_a_number),
            "_steps_to_train": field_validator("max_steps")(_steps_to_train),
        },
        **fields,
    )


def _steps_to_train(value: Any) -> Any:
    """max_steps 0 (or below TrainingArguments' -1, "unset") is refused with the recipe, before anything loads:
    it was taken as unset and refused as "required" once the Trainer stack had loaded."""
    if value is not None and value != -1 and value < 1:
        raise ValueError(f"{value} steps: must be a positive number of optimizer steps (e.g. 1000)")
    return value


def _no_token_in_recipes(value: Any) -> Any:
    if value:
        raise ValueError(
            "tokens never go in a recipe (it is saved with every "
            "checkpoint); remove it and set HF_TOKEN or run `hf auth login`"
        )
    return value


def _known_trackers(value: Any) -> Any:
    """An unknown tracker name fails only when the Trainer is built; refused with the recipe (recipe/report_to.py)."""
    from hftrain.recipe.report_to import check_names

    return check_names(value)


def _admits(annotation: Any, kind: type) -> bool:
    """Whether a field annotation (Optional[...], unions, Literal[...]) accepts values of `kind`."""
    if annotation is kind or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(v, kind) for v in typing.get_args(annotation))
    return any(_admits(arg, kind) for arg in typing.get_args(annotation))


def bool_is_not_a_number(cls: type[BaseModel], value: Any, info: Any) -> Any:
    """`true` for a number field is a mistake (pydantic would read it as 1: `max_steps: true` trained 1 step)."""
    if isinstance(value, bool) and info.field_name in cls.model_fields:
        annotation = cls.model_fields[info.field_name].annotation
        if not _admits(annotation, bool) and (_admits(annotation, int) or _admits(annotation, float)):
            raise ValueError(f"{str(value).lower()} is not a number; give a number here")
    return value


TrainingSection = _training_section()
