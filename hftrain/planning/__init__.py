"""`hftrain plan` on paper, before anyone rents a GPU: parameters, FLOPs and costs (estimates.py), the predicted
peak memory per process (memory.py), and the micro-batch and checkpointing that fit (fit.py, which
`parallelism.fit_memory: true` also uses at the start of `hftrain train`). `plan(recipe)` is the Python API's
entry (`hftrain.plan`): it imports neither the Trainer nor peft, as the command does not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hftrain.model.shape import ModelShape
    from hftrain.recipe.schema import Recipe


def plan(recipe: Recipe, shape: ModelShape | None = None) -> dict[str, Any]:
    """`hftrain.plan(recipe)`: the recipe's model, FLOPs and memory on paper (planning/estimates.py), from its plan
    part; `shape`: the model measured already (else from its config)."""
    from hftrain.planning.estimates import plan as estimate
    from hftrain.planning.part import PlanPart

    return estimate(PlanPart.of(recipe), shape)
