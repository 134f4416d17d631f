"""The checkpoints' part of the recipe (`CheckpointPart.of`, the one place that says what the CheckpointManager
reads of a recipe) and the manager it builds for a run directory (`build`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.checkpoint.manager import CheckpointManager
from hftrain.checkpoint.resume import ResumeSetting

if TYPE_CHECKING:
    from hftrain.parallel.dims import ParallelDims
    from hftrain.recipe.schema import Recipe
    from hftrain.recipe.sections import CheckpointsSection


@dataclass(frozen=True)
class CheckpointPart:
    """What the CheckpointManager reads: the run's identity (model, tokenizer, data), the recipe as run (secrets
    removed) that each checkpoint carries, which checkpoints are kept, whether the weights saved are the full model
    or an adapter on a recorded base, the run directory and where it resumes."""

    identity: dict[str, str]
    recipe_yaml: str
    kept: CheckpointsSection
    save_total_limit: int | None
    base_model: str  # model.from_pretrained ("" for a model trained from scratch)
    full_weights: bool  # finetune.method full (else an adapter)
    output_dir: Path = Path("output")  # training.output_dir: the run directory (checkpoint/layout.py)
    resume: ResumeSetting = ResumeSetting("newest")  # training.resume_from_checkpoint, parsed once

    @classmethod
    def of(cls, recipe: Recipe) -> CheckpointPart:
        from hftrain.recipe.load import fingerprint, recipe_to_dict
        from hftrain.recipe.yaml_io import dump_yaml

        return cls(
            identity=fingerprint(recipe),
            recipe_yaml=dump_yaml(recipe_to_dict(recipe)),
            kept=recipe.checkpoints,
            save_total_limit=recipe.training.save_total_limit,
            base_model=recipe.model.from_pretrained or "",
            full_weights=recipe.finetune.method == "full",
            output_dir=Path(recipe.training.output_dir),
            resume=ResumeSetting.of(recipe.training_kwargs().get("resume_from_checkpoint")),
        )

    def build(self, dims: ParallelDims | None) -> CheckpointManager:
        """The run directory's manager; `dims` None: one that only reads it (the resolver's: what a continuing
        run recorded, whether it is the same run), which cannot save."""
        return CheckpointManager(self, dims)
