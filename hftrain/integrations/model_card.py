"""A model's card (README.md): Hub metadata, the final metrics, the curves, the kept checkpoints' revisions, how
it was trained (its starting weights, data and method) and how to load it without hftrain. Its text is built
from the publish part and results.json alone; integrations/hub.py writes it beside the weights it pushes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yaml

from hftrain.recipe.objectives import OBJECTIVES
from hftrain.recipe.redaction import redact_value

if TYPE_CHECKING:
    from hftrain.integrations.publish import PublishPart

CARD_METRICS = (
    "step",
    "eval_loss",
    "eval_perplexity",
    "eval_preference_accuracy",
    "eval_rewards/accuracies",
    "eval_rewards/margins",
    "tokens_per_s_median",
    "mfu_median",
)
"""results.json values a model card's table shows, where the run has them."""


def model_card(
    part: PublishPart, results: dict[str, Any], repo_id: str, has_plot: bool, revisions: Sequence[str] = ()
) -> str:
    """README.md with Hub metadata, the final metrics, the curves, the kept checkpoints' revisions and how to load the
    model without hftrain."""
    # no user:password@
    sources = [
        redact_value("path", s.dataset or s.path or s.builtin or s.pretokenized or s.megatron) for s in part.train
    ]
    rows = [(k, results.get(k)) for k in CARD_METRICS]
    table = "\n".join(
        f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows if v is not None
    )
    shape = part.from_pretrained or part.preset
    card = f"""---
{yaml.safe_dump(card_metadata(part), sort_keys=False).strip()}
---

# {repo_id}

A GPT-NeoX-style causal language model ({shape}, {_count(results)} parameters) trained with
[hftrain](https://pypi.org/project/hftrain/) on {", ".join(map(str, sources))}.

Training method: {training_method(part)}.

## Results

| metric | value |
| --- | --- |
{table}
"""
    if has_plot:
        card += "\n![loss and gradient norm against step](training_curves.png)\n"
    card += f"""
## Use it

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{repo_id}")
tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
```

The full training recipe (secrets removed) is in `hftrain_recipe.yaml`; per-step metrics in `metrics.jsonl`.
"""
    if revisions:
        card += f"""
## Checkpoints

Kept checkpoints are branches of this repo ({len(revisions)}): {", ".join(f"`{r}`" for r in revisions)}.

```python
model = AutoModelForCausalLM.from_pretrained("{repo_id}", revision="{revisions[-1]}")
```
"""
    return card


def card_metadata(part: PublishPart) -> dict[str, Any]:
    """The model card's Hub metadata (its YAML header)."""
    meta: dict[str, Any] = {
        "library_name": "transformers",
        "license": part.hub.license,
        "pipeline_tag": "text-generation",
        "tags": ["hftrain", "gpt_neox", "text-generation", *part.hub.tags],
    }
    if part.from_pretrained:
        meta["base_model"] = part.from_pretrained
    datasets = [s.dataset for s in part.train if s.dataset]
    if datasets:
        meta["datasets"] = datasets
    meta["tags"] += OBJECTIVES[part.finetune.objective].card_tags
    return meta


def training_method(part: PublishPart) -> str:
    """How the weights were trained, in words: objective, and which weights."""
    weights = {
        "full": "all weights",
        "lora": "a LoRA adapter, merged",
        "qlora": "a LoRA adapter over a 4-bit base (QLoRA), merged",
        "lora_8bit": "a LoRA adapter over an 8-bit base, merged",
    }[part.finetune.method]
    kind = (
        "supervised fine-tuning on instruction data"
        if part.instruction_data
        else ("fine-tuning" if part.from_pretrained else "pretraining")
    )
    beta = part.finetune.dpo.get("beta", 0.1)
    return OBJECTIVES[part.finetune.objective].describe.format(kind=kind, weights=weights, beta=beta)


def _count(results: dict[str, Any]) -> str:
    total = results.get("parameters", {}).get("total")
    return f"{total:,}" if isinstance(total, int) else "?"
