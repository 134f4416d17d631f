"""The plan's part of the recipe (`PlanPart.of`): what a run's plan on paper, the checks before a launch and
`hftrain parity` read of a recipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hftrain.model.part import ModelPart
from hftrain.parallel.batch import BatchPart
from hftrain.planning.run_length import RunLengthPart

if TYPE_CHECKING:
    from hftrain.recipe.data_section import DataSection
    from hftrain.recipe.finetune_section import FinetuneSection
    from hftrain.recipe.schema import Recipe
    from hftrain.recipe.training_section import TrainingSection


@dataclass(frozen=True)
class PlanPart:
    """What a run's plan on paper reads: the peak-memory prediction (planning/memory.py: the finetune section, the
    data section, the training section, parallelism.strategy, model.attn_implementation), `hftrain plan`'s estimates
    (planning/estimates.py: the model's part, measured from its config; the batch, for the tokens per step; the run
    length, for the planned steps), the checks made once before a run's processes start (launch/processes.py,
    script_checks.py: the method against the backend, the precision of a CPU rehearsal, the checkpoint the run would
    resume, an elastic launch's batch, the memory fit) and `hftrain parity`'s runs (launch/parity.py: the batch it
    splits over 2 processes, training.output_dir, the data section and training.seed)."""

    finetune: FinetuneSection
    data: DataSection
    training: TrainingSection
    strategy: str
    attention: str | None
    model: ModelPart
    batch: BatchPart
    run_length: RunLengthPart

    @classmethod
    def of(cls, recipe: Recipe) -> PlanPart:
        p, m = recipe.parallelism, recipe.model
        return cls(
            recipe.finetune,
            recipe.data,
            recipe.training,
            strategy=p.strategy,
            attention=m.attn_implementation,
            model=ModelPart.of(recipe),
            batch=BatchPart.of(recipe),
            run_length=RunLengthPart.of(recipe),
        )

    @property
    def training_kwargs(self) -> dict[str, Any]:
        """The TrainingArguments keys the recipe sets (Recipe.training_kwargs)."""
        return self.training.model_dump(exclude_unset=True)

    @property
    def output_dir(self) -> str:
        return self.training.output_dir

    @property
    def seed(self) -> int:
        return self.training.seed
