"""The data commands' part of the recipe (`DataPart.of`: what `hftrain data prepare`, `inspect` and
`--check-packing` read of a recipe; a training run's data plan is the resolver's, data/loader.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hftrain.model.part import ModelPart

if TYPE_CHECKING:
    from hftrain.recipe.data_section import DataSection
    from hftrain.recipe.schema import Recipe


@dataclass(frozen=True)
class DataPart:
    """What `hftrain data prepare` and `hftrain data inspect` read (data/prepare.py, inspect.py, packing_check.py):
    the data section, training.seed (the order the sources are read in), the micro-batch size
    (training.per_device_train_batch_size: --check-packing's batch) and the model's part (its tokenizer, its shape)."""

    data: DataSection
    seed: int
    batch_size: int
    model: ModelPart

    @classmethod
    def of(cls, recipe: Recipe) -> DataPart:
        t = recipe.training
        return cls(data=recipe.data, seed=t.seed, batch_size=t.per_device_train_batch_size, model=ModelPart.of(recipe))
