"""DPO: TRL's DPOTrainer and DPOConfig, with everything hftrain adds to a Trainer.

hftrain writes no preference objective of its own. ``PreferenceTrainer`` puts HftrainTrainer's overrides (the
resumable data stream, staged checkpoints with their marker, step timing and metrics, the non-finite guard,
the evaluation extras) in front of DPOTrainer in the method order, so each calls on into TRL's, and TRL's
into the Trainer's: the loss, the reference log-probabilities and the rewards are TRL's alone
(tests/training/test_preference.py: the first step's loss equals a plain DPOTrainer's on the same batch).

The reference: with an adapter (lora, qlora) TRL disables the adapter (hftrain hands it the LoraConfig, so no
second copy of the weights exists); with full fine-tuning it is a frozen copy of the starting weights, built
the way the policy was (planning/memory.py counts it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hftrain import _compat
from hftrain.data.loader import first_pairs
from hftrain.data.preference_pairs import needs_chat_template, use_chatml
from hftrain.data.validation_set import validation_pairs
from hftrain.errors import HftrainError
from hftrain.eval.preference_accuracy import PreferenceEvaluation
from hftrain.model.build import build_model
from hftrain.model.finetune import prepare_adapter
from hftrain.training.trainer import HftrainTrainer, TrainerOptions

if TYPE_CHECKING:
    from hftrain.model.part import ModelPart

TRAINING_DEFAULTS = ("learning_rate", "bf16", "gradient_checkpointing", "logging_steps")
"""TrainingArguments keys whose default DPOConfig changes: a recipe keeps TrainingArguments' meaning (and the
speed and memory defaults hftrain decides) whatever its objective."""


def dpo_arguments(kwargs: dict[str, Any], dpo: dict[str, Any], seq_len: int) -> Any:
    """DPOConfig from the TrainingArguments keys and the recipe's finetune.dpo keys; the sequence limit is
    data.seq_len."""
    import dataclasses

    from transformers import TrainingArguments
    from trl import DPOConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.name in TRAINING_DEFAULTS}
    return DPOConfig(**{**defaults, **kwargs, **dpo, "max_length": seq_len})


def train_records(first: list[dict[str, Any]]) -> Any:
    """The dataset DPOTrainer requires and inspects at its start (the first training pairs, read lazily); the
    batches come from hftrain's stream (get_train_dataloader)."""
    from datasets import IterableDataset

    return IterableDataset.from_generator(_yield, gen_kwargs={"rows": first})


def _yield(rows: list[dict[str, Any]]) -> Any:
    yield from rows


def eval_records(pairs: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(pairs)


def _trainer_class() -> type:
    from trl import DPOTrainer

    class PreferenceTrainer(HftrainTrainer, DPOTrainer):
        """TRL's DPOTrainer behind hftrain's overrides (see the module docstring)."""

        def create_model_card(self, *args: Any, **kwargs: Any) -> None:
            """hftrain writes the model card (integrations/hub.py), naming the method; TRL's would go to the run's
            root."""

    return PreferenceTrainer


def preference_trainer(
    part: ModelPart,
    options: TrainerOptions,
    model: Any,
    args: Any,
    tokenizer: Any,
    callbacks: list[Any],
    tokenizer_is_new: bool = False,
) -> HftrainTrainer:
    """The DPO trainer: TRL's reference (adapter disabled, or a frozen copy of the starting
    weights), TRL's evaluation set and collator, hftrain's stream and held-out preference accuracy."""
    held_out, first = validation_pairs(options.data), first_pairs(options.data, 4)
    if needs_chat_template(tokenizer, first[0]):
        use_chatml(tokenizer)
    model, adapter = prepare_adapter(model, part, args.gradient_checkpointing)
    reference = None
    if adapter is None:
        reference = build_model(part, tokenizer, tokenizer_is_new, options.dims).eval().requires_grad_(False)
    options = replace(options, evaluation=PreferenceEvaluation(held_out, tokenizer))
    import datasets

    _compat.quiet_trl_deprecations()
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # TRL's tokenization of the held-out pairs: three bars per rank, at start
    try:
        return _trainer_class()(
            model=model,
            ref_model=reference,
            args=args,
            train_dataset=train_records(first),
            eval_dataset=eval_records(held_out),
            processing_class=tokenizer,
            peft_config=adapter,
            callbacks=callbacks,
            options=options,
        )
    except (ValueError, NotImplementedError) as err:  # TRL's checks of its keys against the model and data
        raise HftrainError(f"finetune.dpo: TRL's DPOTrainer refuses this run: {err}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
