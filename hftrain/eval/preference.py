"""Preference accuracy: the share of held-out pairs whose chosen answer the model itself finds more likely
(summed log-probability of the answer given the prompt) than the rejected one.

DPO's own evaluation metrics (TRL's rewards/accuracies and rewards/margins) measure the policy against its
reference, so they are 0 before the first step; this measures the model alone, so it is meaningful before
training, after it, and on an exported model in plain transformers (any causal LM and its tokenizer).
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.data.preference import encode_pair


@torch.no_grad()
def answer_logps(model: Any, pairs: list[dict[str, list[int]]], pad: int, batch_size: int = 16) -> torch.Tensor:
    """Summed log-probabilities of (chosen, rejected) answers given their prompt: shape (pairs, 2)."""
    rows = [(p["prompt_ids"], p[key]) for p in pairs for key in ("chosen_ids", "rejected_ids")]
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        width = max(len(prompt) + len(answer) for prompt, answer in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        answer_mask = torch.zeros((len(chunk), width), dtype=torch.bool)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (prompt, answer) in enumerate(chunk):
            n = len(prompt) + len(answer)
            ids[r, :n] = torch.tensor(prompt + answer)
            answer_mask[r, len(prompt) : n] = True
            attention[r, :n] = 1
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.float()
        logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
        out.append((logps * answer_mask[:, 1:].to(device)).sum(-1).cpu())
    return torch.cat(out).view(-1, 2)


def preference_accuracy(model: Any, tokenizer: Any, records: list[dict[str, Any]]) -> float:
    """The share of pair records (prompt, chosen, rejected) whose chosen answer the model prefers."""
    pairs = [encode_pair(tokenizer, r) for r in records]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
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
        self.records, self.tokenizer = records, tokenizer

    def metrics(self, model: Any, loss: float | None, prefix: str) -> dict[str, float]:
        return {f"{prefix}_preference_accuracy": round(preference_accuracy(model, self.tokenizer, self.records), 4)}
