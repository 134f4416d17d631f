"""The objective is one interface (issue 43 part 4): each objective's facts (recipe/objectives.py) and its
TrainingArguments and Trainer builders (training/objectives.py) are complete, and no module asks "is it DPO?"."""

from __future__ import annotations

import re
import typing

from hftrain.recipe.finetune_section import FinetuneSection
from hftrain.recipe.objectives import OBJECTIVES
from hftrain.training import objectives

from ..support.cli import ROOT

# where an objective's name may be compared: its facts, its builders, and the recipe section of its own keys
OWNERS = {"hftrain/recipe/objectives.py", "hftrain/training/objectives.py", "hftrain/recipe/finetune_section.py"}
COMPARED = re.compile(r"objective\s*(==|!=|in)\s*[\"'(\[]")


def test_every_objective_has_its_facts_arguments_and_trainer():
    choices = set(typing.get_args(FinetuneSection.model_fields["objective"].annotation))
    assert choices == set(OBJECTIVES) == set(objectives.BUILDERS)
    assert all(goal.name == name for name, goal in OBJECTIVES.items())


def test_no_module_branches_on_the_objectives_name():
    """Before: 14 `objective == "dpo"` checks in 8 modules."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "hftrain").rglob("*.py"))
        if str(path.relative_to(ROOT)) not in OWNERS
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if COMPARED.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_branch_check_can_fail():
    assert COMPARED.search('    dpo = recipe.finetune.objective == "dpo"')
    assert COMPARED.search("    if shape.objective != 'dpo' or method != 'full':")
    assert not COMPARED.search("    goal = OBJECTIVES[recipe.finetune.objective]")
