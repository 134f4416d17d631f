"""Metrics added to every evaluation during training (at eval_steps and at the end), beyond the loss.

* ``eval_perplexity`` and ``eval_bits_per_byte`` on the validation blocks: bits per byte does not depend on
  the tokenizer, so runs with different tokenizers compare;
* one number per ``monitor.eval_tasks`` entry, computed with the same functions as ``hftrain eval``:
  ``eval_<name>_<metric>`` (perplexity, bits_per_byte or last_word_accuracy).

Every process computes them (a sharded model's forward needs all ranks); the main process logs them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from hftrain.errors import HftrainError
from hftrain.eval import text_metrics
from hftrain.recipe.sections import EvalTask

HEADLINE = {"perplexity": "perplexity", "bits_per_byte": "bits_per_byte", "last_word_accuracy": "accuracy"}


def scored_tokens_and_bytes(blocks: list[dict[str, Any]], tokenizer: Any) -> tuple[int, int]:
    """Tokens the loss averages over (labels after the one-position shift) and the UTF-8 bytes they decode to."""
    tokens = n_bytes = 0
    for block in blocks:
        if "shift_labels" in block:  # a stored row: every next token is a target
            scored = [token for token in block["shift_labels"].tolist() if token != -100]
        else:
            ids, labels = block["input_ids"].tolist(), block["labels"].tolist()
            scored = [token for token, label in zip(ids[1:], labels[1:]) if label != -100]
        tokens += len(scored)
        n_bytes += len(tokenizer.decode(scored).encode("utf-8"))
    return tokens, n_bytes


def task_name(task: EvalTask) -> str:
    if task.name:
        return task.name
    stem = Path(task.data.rstrip("/").split("?")[0]).name
    return stem.split(".")[0] or "task"


class TrainingEvaluation:
    def __init__(self, blocks: list[dict[str, Any]], tokenizer: Any, tasks: list[EvalTask]):
        self.tokenizer, self.tasks = tokenizer, tasks
        self.tokens, self.bytes = scored_tokens_and_bytes(blocks, tokenizer)
        # read once, up front: a missing file is a recipe error before training, not at the first eval
        self.texts = []
        for i, task in enumerate(tasks):
            try:
                self.texts.append(text_metrics.load_texts(task.data, task.text_field, task.limit))
            except HftrainError as err:
                raise HftrainError(f"monitor.eval_tasks[{i}].data: {err}") from None

    def metrics(self, model: Any, loss: float | None, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        if loss is not None and math.isfinite(loss):
            out[f"{prefix}_perplexity"] = math.exp(min(loss, 50.0))
            if self.bytes:
                out[f"{prefix}_bits_per_byte"] = loss * self.tokens / (math.log(2) * self.bytes)
        if not self.tasks:
            return out
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for task, texts in zip(self.tasks, self.texts):
                    result = text_metrics.evaluate_texts(
                        model, self.tokenizer, texts, [task.metric], task.context, task.stride
                    )
                    out[f"{prefix}_{task_name(task)}_{task.metric}"] = result[task.metric][HEADLINE[task.metric]]
        finally:
            model.train(was_training)
        return out
