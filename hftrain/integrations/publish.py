"""Sharing a model: the publish part of the recipe (`PublishPart.of`, the one place that says what the Hub, S3,
revisions and the model card read of a recipe), the pusher it builds for a run (`build`), and `hftrain push`'s
later push of a run directory or a model directory (`push_run`)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain import network
from hftrain.checkpoint.layout import COMPLETE_MARKER, RECIPE_FILE, RunLayout
from hftrain.errors import HftrainError
from hftrain.integrations.hub import CheckpointPusher, bundle, copy_to_fsspec, push_folder
from hftrain.integrations.outbox import Outbox
from hftrain.integrations.revisions import publisher
from hftrain.recipe.load import read_part

if TYPE_CHECKING:
    from hftrain.recipe.data_section import Source
    from hftrain.recipe.finetune_section import FinetuneSection
    from hftrain.recipe.schema import Recipe
    from hftrain.recipe.sections import CheckpointsSection, HubSection


@dataclass(frozen=True)
class PublishPart:
    """What sharing a model reads (hub.py, revisions.py, model_card.py): where it goes (the hub section: s3_uri,
    storage_options, the card's license and tags), which checkpoints are pushed as revisions (the checkpoints
    section), the bound of a later `hftrain push` (faults.network_timeout_s), and what the model card says of the
    run: its starting weights (model.from_pretrained, model.preset), its training sources (data.train, and whether
    they are instruction data) and how the weights were trained (the finetune section)."""

    hub: HubSection
    checkpoints: CheckpointsSection
    network_timeout_s: float
    from_pretrained: str | None
    preset: str | None
    train: tuple[Source, ...]
    instruction_data: bool
    finetune: FinetuneSection
    push_to_hub: bool = False  # training.push_to_hub: the final model (and revisions) to the Hub, by hftrain

    @classmethod
    def of(cls, recipe: Recipe) -> PublishPart:
        m, data = recipe.model, recipe.data
        return cls(
            push_to_hub=bool(recipe.training_kwargs().get("push_to_hub", False)),
            hub=recipe.hub,
            checkpoints=recipe.checkpoints,
            network_timeout_s=recipe.faults.network_timeout_s,
            from_pretrained=m.from_pretrained,
            preset=m.preset,
            train=tuple(data.train),
            instruction_data=data.instruction_data,
            finetune=recipe.finetune,
        )

    def build(self, args: Any, outbox: Outbox) -> CheckpointPusher:
        """What shares the run's checkpoints (Hub, S3, revisions) through the run's outbox: a service that is down
        never stops or slows training (outbox.py)."""
        revisions = publisher(self, args, self.push_to_hub, outbox)
        return CheckpointPusher(self, args, self.push_to_hub, outbox, revisions)


def push_run(
    path: Path, *, repo_id: str | None, to: str | None, private: bool | None = None, revision: str | None = None
) -> str:
    """`hftrain push`: a run directory (its final model) or a model directory, to the hub or an fsspec URL."""
    path = Path(path)
    final = RunLayout(path).final
    model_dir = final if (final / "config.json").is_file() else path
    checkpoint = (
        model_dir / COMPLETE_MARKER
    ).is_file()  # --to copies a checkpoint as it is (a sharded or adapter one too)
    if not (model_dir / "config.json").is_file() and not (to and checkpoint):
        raise HftrainError(f"{path}: neither a run directory with final/ nor a model directory (no config.json).")
    run_dir = path if model_dir != path else path.parent
    recipe_file = model_dir / RECIPE_FILE
    saved = recipe_file.is_file()  # a run's model; else a model directory of its own, published with the defaults
    part = (
        read_part(PublishPart.of, recipe_file)
        if saved
        else read_part(PublishPart.of, model={"from_pretrained": str(model_dir)})
    )
    network.configure(part.network_timeout_s)  # the run's own bound for its push
    if to:
        return copy_to_fsspec(model_dir, to, part.hub.storage_options)
    if not repo_id:
        raise HftrainError("push: give --repo-id NAMESPACE/NAME (or --to s3://bucket/path).")
    # links, not a /tmp copy
    folder = bundle(run_dir, model_dir, part, repo_id, into=run_dir if os.access(run_dir, os.W_OK) else None)
    try:
        push_folder(folder, repo_id, private=private, revision=revision, message="hftrain push")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return f"hub:{repo_id}" + (f"@{revision}" if revision else "")
