"""`Run`: what a finished run leaves behind, returned by `hftrain.train` for the CLI summary and notebooks.

A record (what the run became, directories, metrics, sample, the Trainer); its methods are one-line conveniences
over weights.py (the trained model), plot.py, hub.py and generation.py. What the run became is `AsRun`, a small
record of the choices the resolver made, never the recipe itself (the recipe as run is in `recipe_yaml`, and
`hftrain.load_recipe(run.recipe_file)` reads it back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import RECIPE_FILE, RunLayout


@dataclass(frozen=True)
class AsRun:
    """What the recipe became in this run: the layout the resolver chose (the memory fit may change the batch keys)
    and the run's length, and the recipe as run, secrets redacted (each checkpoint's hftrain_recipe.yaml)."""

    strategy: str  # single | ddp | fsdp | zero3 | device_map
    processes: int
    micro_batch: int
    gradient_accumulation_steps: int
    global_batch: int  # sequences per optimizer step
    gradient_checkpointing: bool
    max_steps: int
    recipe_yaml: str


@dataclass
class Run:
    as_run: AsRun
    output_dir: Path
    final_dir: Path
    trainer: Any  # the HftrainTrainer that ran
    metrics: dict[str, float] = field(default_factory=dict)
    sample: str = ""
    plot_path: Path | None = None
    not_shared: list[Any] = field(default_factory=list)  # outbox.Failure: what was not sent (Hub, S3, trackers)
    _model: Any = None

    @property
    def recipe_file(self) -> Path:
        """The recipe as run, saved with the final model (`hftrain.load_recipe` reads it)."""
        return self.final_dir / RECIPE_FILE

    @property
    def log_history(self) -> list[dict[str, Any]]:
        return self.trainer.state.log_history

    @property
    def last_loss(self) -> float | None:
        losses = [e["loss"] for e in self.log_history if "loss" in e]
        return losses[-1] if losses else None

    @property
    def model(self) -> Any:
        """The trained model; read back from final_dir when training sharded it over processes."""
        if self._model is None:
            from hftrain.checkpoint.weights import trained_model

            self._model = trained_model(self.trainer, self.final_dir)
        return self._model

    def plot(self) -> Any:
        """The loss / grad-norm curves: shown inline in a notebook, else the PNG's path."""
        from hftrain.training.plot import plot_curves

        path = self.plot_path or plot_curves(
            self.log_history, RunLayout(self.output_dir).plot, title=str(self.output_dir)
        )
        try:
            from IPython.display import Image

            return Image(filename=str(path))
        except ImportError:
            return path

    def push(
        self,
        repo_id: str | None = None,
        *,
        to: str | None = None,
        private: bool | None = None,
        revision: str | None = None,
    ) -> str:
        """Share the final model: to the hub (repo_id) or to an s3:// / fsspec URL (to)."""
        from hftrain.integrations.publish import push_run

        return push_run(self.output_dir, repo_id=repo_id, to=to, private=private, revision=revision)

    def generate(self, prompt: str, max_new_tokens: int = 48, seed: int = 0) -> str:
        """Sample a continuation of `prompt` from the trained model (top-k 40, temperature 0.8)."""
        from hftrain.model.generation import sample

        return sample(self.model, self.trainer.processing_class, prompt, max_new_tokens, seed)
