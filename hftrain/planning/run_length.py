"""How long a run is: optimizer steps, given directly or derived from a token budget or a number of epochs.

hftrain streams its data, so a run is counted in optimizer steps. A recipe may give instead:
- ``data.train_tokens``: tokens to train on; steps = ceil(train_tokens / tokens per step);
- ``training.num_train_epochs`` with pre-tokenized data: passes over the token folders' tokens.
Tokens per step = global batch (micro-batch x gradient accumulation x processes) x data.seq_len, so the same
budget gives the same number of tokens on any launch whose global batch is the same.
When several are set, the first of training.max_steps, data.train_tokens, training.num_train_epochs wins
(as in transformers, where max_steps overrides num_train_epochs), and the run says which one it used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hftrain.errors import HftrainError

if TYPE_CHECKING:
    from hftrain.recipe.schema import Recipe

ORDER = ("training.max_steps", "data.train_tokens", "training.num_train_epochs")


@dataclass(frozen=True)
class RunLength:
    max_steps: int
    tokens_per_step: int
    source: str  # which key decided: one of ORDER
    note: str  # one line for the console and results.json
    start_step: int = 0  # data.start_step: the corpus step of this run's first step (stored order)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_steps": self.max_steps,
            "start_step": self.start_step,
            "tokens_per_step": self.tokens_per_step,
            "from": self.source,
            "tokens": self.max_steps * self.tokens_per_step,
            "note": self.note,
        }


@dataclass(frozen=True)
class RunLengthPart:
    """What the run's length is derived from: training.max_steps, data.train_tokens,
    training.num_train_epochs (when written), data.seq_len, checkpoints.steps (each must be reached) and
    data.start_step (the corpus step a stored-order run begins at)."""

    max_steps: int | None
    train_tokens: int | None
    epochs: float | None
    epochs_given: bool
    seq_len: int
    kept_steps: tuple[int, ...] = ()
    start_step: int = 0  # data.start_step (stored order): where in the corpus the run's steps begin

    @classmethod
    def of(cls, recipe: Recipe) -> RunLengthPart:
        kwargs = recipe.training_kwargs()
        return cls(
            max_steps=kwargs.get("max_steps"),
            train_tokens=recipe.data.train_tokens,
            epochs=kwargs.get("num_train_epochs"),
            epochs_given="num_train_epochs" in recipe.training.model_fields_set,
            seq_len=recipe.data.seq_len,
            kept_steps=tuple(recipe.checkpoints.steps),
            start_step=recipe.data.start_step or 0,
        )

    def given(self) -> dict[str, Any]:
        """The run-length keys this recipe sets, in precedence order."""
        found: dict[str, Any] = {}
        if (self.max_steps or -1) > 0:
            found["training.max_steps"] = self.max_steps
        if self.train_tokens is not None:
            found["data.train_tokens"] = self.train_tokens
        if self.epochs_given:
            found["training.num_train_epochs"] = self.epochs
        return found

    def build(self, global_batch: int, folder_tokens: int | None) -> RunLength:
        """max_steps for TrainingArguments, from whichever run-length key wins. `global_batch`: sequences per step
        (ParallelDims.global_batch); `folder_tokens` is the prepared data's size, if any."""
        per_step = global_batch * self.seq_len
        found = self.given()
        if not found:
            raise HftrainError(
                "training.max_steps: required. hftrain streams its data, so a run is measured in optimizer steps; set "
                "training.max_steps (e.g. 1000), data.train_tokens (a token budget), or, with pre-tokenized data, "
                "training.num_train_epochs."
            )
        source, value = next(iter(found.items()))
        unused = [key for key in found if key != source]
        if source == "training.max_steps":
            steps, how = int(value), f"training.max_steps={value}"
        elif source == "data.train_tokens":
            steps = max(1, math.ceil(value / per_step))
            how = f"data.train_tokens={value:,} / {per_step:,} tokens per step = {steps:,} steps"
        else:
            if folder_tokens is None:
                raise HftrainError(
                    "training.num_train_epochs: epochs need the data's token count, which only pre-tokenized data "
                    "has; prepare it with `hftrain data prepare` (data.train: {pretokenized: DIR}), or give "
                    "data.train_tokens or training.max_steps instead."
                )
            if value is None or value <= 0:
                raise HftrainError(f"training.num_train_epochs: {value} is not a positive number of epochs.")
            steps = max(1, math.ceil(value * folder_tokens / per_step))
            how = (
                f"training.num_train_epochs={value:g} x {folder_tokens:,} "
                f"prepared tokens / {per_step:,} tokens per step = {steps:,} steps"
            )
        note = f"run length: {how}" + (f" ({' and '.join(unused)} not used: {source} wins)" if unused else "")
        if self.start_step:
            first, last = self.start_step, self.start_step + steps - 1
            note += f"; from data.start_step={first:,}: corpus steps {first:,} to {last:,}"
        beyond = [s for s in self.kept_steps if s > steps]  # given max_steps, the recipe's load refused these
        if beyond:
            raise HftrainError(
                f"checkpoints.steps: {', '.join(map(str, beyond))} after this run's last step ({how}) would never "
                f"be kept; remove them, or lengthen the run (a longer run continues this one)."
            )
        return RunLength(steps, per_step, source, note, self.start_step)
