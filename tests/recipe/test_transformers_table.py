"""recipe/transformers_table.py: the training section read from a table kept per installed transformers is the
one TrainingArguments itself gives (every field, default, help text, and what each type accepts), and a kept table
is read without importing the Trainer stack."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest
from pydantic import ConfigDict, TypeAdapter, ValidationError

from hftrain.recipe import transformers_table
from hftrain.recipe.training_section import TrainingSection

SAMPLES = [
    None,
    True,
    False,
    0,
    3,
    1.5,
    -2,
    "",
    "steps",
    "no",
    "epoch",
    "adamw_torch_fused",
    "cosine",
    "x",
    ["a"],
    [],
    {"a": 1},
    {},
]


def accepted(annotation: Any, value: Any) -> tuple[bool, Any]:
    adapter = TypeAdapter(annotation | None, config=ConfigDict(arbitrary_types_allowed=True))
    try:
        return True, adapter.validate_python(value)
    except ValidationError:
        return False, None


def test_the_table_gives_exactly_what_training_arguments_gives():
    from transformers import TrainingArguments
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    hints = typing.get_type_hints(TrainingArguments)
    real = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init and not f.name.startswith("_")}
    table = {f.name: f for f in transformers_table.training_fields()}
    assert list(table) == list(real)
    assert [str(f.annotation) for f in table.values()] == [str(hints[name]) for name in real]  # as `explain` shows them
    assert set(TrainingSection.model_fields) == set(real)
    for name, field in real.items():
        made = field.default_factory  # type: ignore[misc]
        default = field.default if field.default is not dataclasses.MISSING else made()
        assert table[name].default == default and table[name].help == field.metadata.get("help"), name
        original = hints[name]
        # ParallelismConfig: TrainingArguments checks it
        if "class" not in json.dumps(transformers_table.encode(original)):
            for value in SAMPLES:
                assert accepted(table[name].annotation, value) == accepted(original, value), (name, value)
    assert transformers_table.tracker_names() == list(INTEGRATION_TO_CALLBACK)


def test_the_check_can_fail():
    """A table that lost an enum's values or a union member is caught by the comparison above."""
    from transformers.trainer_utils import IntervalStrategy

    shrunk = transformers_table.decode({"enum": "IntervalStrategy", "values": ["no", "steps"]})
    assert accepted(shrunk, "epoch") != accepted(IntervalStrategy, "epoch")
    assert accepted(transformers_table.decode("int"), 1.5) != accepted(int | float, 1.5)


@pytest.mark.parametrize(
    "annotation",
    [
        int,
        str | None,
        dict[str, Any] | str | None,
        list[str] | None,
        str | None | typing.Literal[False],
        str | list[str],
    ],
)
def test_types_travel_as_json(annotation):
    encoded = json.loads(json.dumps(transformers_table.encode(annotation)))
    for value in SAMPLES:
        assert accepted(transformers_table.decode(encoded), value) == accepted(annotation, value), value


def test_a_table_is_kept_per_transformers_and_half_a_file_is_made_again(tmp_path, monkeypatch):
    """Kept once (tests/test_structure.py::test_cheap_commands_answer_without_the_trainer_stack shows a kept table
    is read without importing transformers); an unreadable one (a full disk) reads as missing and is made again."""
    monkeypatch.setenv("HFTRAIN_CACHE_DIR", str(tmp_path))
    transformers_table.table.cache_clear()
    try:
        made = transformers_table.table()
        (kept,) = tmp_path.glob("transformers-table-*.json")
        assert json.loads(kept.read_text()) == made
        kept.write_text('{"version": 1, "fiel')
        transformers_table.table.cache_clear()
        assert transformers_table.table() == made and json.loads(kept.read_text()) == made
    finally:
        transformers_table.table.cache_clear()
