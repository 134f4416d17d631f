"""What a training objective means to every part of a run, in one table (``finetune.objective``).

The model builder (FLOPs per token, whether random weights can start it), `hftrain plan` (rows per example, a
reference model's memory, the loss head's logits), the run (hftrain's chunked loss, who wraps the adapter) and the
model card (tags, the method in words) read these facts instead of asking "is it DPO?". A new objective adds its
entry here and its trainer in training/objectives.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    rows_per_example: int
    """Sequences the loss reads per example: a preference pair's chosen and rejected answers are 2."""
    flops_factor: float
    """Training FLOPs per token relative to the next-token loss (DPO: the reference's forward adds a third)."""
    reference_copy: bool
    """With full fine-tuning, a frozen copy of the starting weights is kept as a reference (its memory counts)."""
    wraps_adapter: bool
    """Its trainer wraps the fine-tuning method's adapter itself (TRL takes the LoraConfig)."""
    tiled_loss_head: bool
    """Its trainer scores log-probabilities in tiles (TRL's fused head): no batch x seq_len x vocab logits, and
    hftrain's chunked CPU loss does not apply."""
    data_format: str
    """The data.train format it learns from ("preference": prompt, chosen, rejected); "" for text, instruction
    and chat data."""
    trained_weights: str
    """Why random weights cannot start it ("" where they can); said when a preset has no from_pretrained."""
    card_tags: tuple[str, ...]
    sections: str
    """The recipe sections its TrainingArguments come from, named when they are refused."""
    describe: str
    """The training method in words on the model card ({beta}, {weights}: see model_card_method)."""


OBJECTIVES: dict[str, Objective] = {
    "lm": Objective(
        name="lm",
        rows_per_example=1,
        flops_factor=1.0,
        reference_copy=False,
        wraps_adapter=False,
        tiled_loss_head=False,
        data_format="",
        trained_weights="",
        card_tags=(),
        sections="training",
        describe="{kind} (next-token loss), {weights}",
    ),
    "dpo": Objective(
        name="dpo",
        rows_per_example=2,
        flops_factor=4 / 3,
        reference_copy=True,
        wraps_adapter=True,
        tiled_loss_head=True,
        data_format="preference",
        trained_weights="aligns a trained model's preferences",
        card_tags=("dpo", "trl"),
        sections="training / finetune.dpo",
        describe="DPO (Direct Preference Optimization, TRL's DPOTrainer, beta {beta}) on preference pairs, {weights}",
    ),
}
