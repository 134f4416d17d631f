"""Preference accuracy: the share of held-out pairs whose chosen answer the model itself finds more likely
(summed log-probability of the answer given the prompt) than the rejected one.

DPO's own evaluation metrics (TRL's rewards/accuracies and rewards/margins) measure the policy against its
reference, so they are 0 before the first step; this measures the model alone, so it is meaningful before
training, after it, and on an exported model in plain transformers (any causal LM and its tokenizer).
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.data.preference_pairs import encode_pair

LOGIT_BUDGET_BYTES = 256e6
"""Logits per forward (fp32, with their log-probabilities): rows are batched up to this, one row at least, so
the memory depends on seq_len and the vocabulary, not on how many held-out pairs there are (planning/memory.py)."""


def _batches(
    rows: list[tuple[list[int], list[int]]], vocab: int, batch_size: int
) -> list[list[tuple[list[int], list[int]]]]:
    """Consecutive rows, at most `batch_size` and LOGIT_BUDGET_BYTES of logits each (the same on every rank:
    under FSDP and ZeRO-3 every forward is a collective)."""
    batches: list[list[tuple[list[int], list[int]]]] = []
    current: list[tuple[list[int], list[int]]] = []
    width = 0
    for row in rows:
        wider = max(width, len(row[0]) + len(row[1]))
        if current and (len(current) == batch_size or 8 * (len(current) + 1) * wider * vocab > LOGIT_BUDGET_BYTES):
            batches.append(current)
            current, wider = [], len(row[0]) + len(row[1])
        current.append(row)
        width = wider
    return batches + ([current] if current else [])


@torch.no_grad()
def answer_logps(model: Any, pairs: list[dict[str, list[int]]], pad: int, batch_size: int = 16) -> torch.Tensor:
    """Summed log-probabilities of (chosen, rejected) answers given their prompt: shape (pairs, 2)."""
    rows = [(p["prompt_ids"], p[key]) for p in pairs for key in ("chosen_ids", "rejected_ids")]
    device = next(model.parameters()).device
    out = []
    for chunk in _batches(rows, model.config.vocab_size, batch_size):
        width = max(len(prompt) + len(answer) for prompt, answer in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        answer_mask = torch.zeros((len(chunk), width), dtype=torch.bool)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (prompt, answer) in enumerate(chunk):
            n = len(prompt) + len(answer)
            ids[r, :n] = torch.tensor(prompt + answer)
            answer_mask[r, len(prompt) : n] = True
            attention[r, :n] = 1
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits[:, :-1].float()
        target = logits.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
        logps = target - torch.logsumexp(logits, dim=-1)
        del logits
        out.append((logps * answer_mask[:, 1:].to(device)).sum(-1).cpu())
    return torch.cat(out).view(-1, 2)


def preference_accuracy(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> float:
    """The share of pair records (prompt, chosen, rejected) whose chosen answer the model prefers."""
    return accuracy_of_pairs(model, [encode_pair(tokenizer, r) for r in records], _pad_id(tokenizer))


def _pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def accuracy_of_pairs(model: Any, pairs: list[dict[str, list[int]]], pad: int) -> float:
    """preference_accuracy on pairs already tokenized (encode_pair)."""
    was_training = model.training
    model.eval()
    try:
        logps = answer_logps(model, pairs, pad)
    finally:
        model.train(was_training)
    return float((logps[:, 0] > logps[:, 1]).float().mean())


class PreferenceEvaluation:
    """What each evaluation of a DPO run adds to TRL's metrics: the held-out preference accuracy."""

    def __init__(self, records: list[dict[str, Any]], tokenizer: Any):
        self.pairs, self.pad = [encode_pair(tokenizer, r) for r in records], _pad_id(tokenizer)  # tokenized once

    def metrics(self, model: Any, loss: float | None, prefix: str) -> dict[str, float]:
        return {f"{prefix}_preference_accuracy": round(accuracy_of_pairs(model, self.pairs, self.pad), 4)}
