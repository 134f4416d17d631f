"""Sampling a continuation from a trained model: the run's end-of-training sample and `Run.generate`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hftrain.recipe.sections import MonitorSection


def sample(
    model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 48, seed: int = 0, temperature: float = 0.8
) -> str:
    """A continuation of `prompt` (top-k 40 at `temperature`; 0: greedy), leaving the model's train/eval mode as
    it was."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    how = {"do_sample": True, "top_k": 40, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **how)
    model.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def end_of_run_sample(model: Any, tokenizer: Any, monitor: MonitorSection) -> str:
    """The sample a run shows when it ends, as its monitor section says (sample_prompt, sample_max_new_tokens,
    sample_temperature): a new key of that sample is read here, from the section, and nowhere else."""
    return sample(model, tokenizer, monitor.sample_prompt, monitor.sample_max_new_tokens, 0, monitor.sample_temperature)
