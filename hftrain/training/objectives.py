"""How each objective is built: its TrainingArguments and its Trainer, one line per objective in BUILDERS (what an
objective means elsewhere in the run, its data, FLOPs and model card, is recipe/objectives.py, which reads no
training library). A new objective adds its builders (a module of its own, as DPO's dpo.py) and one line
here; tests/training/test_objectives.py checks that both tables name the same objectives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hftrain.data.validation_set import validation_blocks
from hftrain.eval.during_training import TrainingEvaluation
from hftrain.progress import phase
from hftrain.recipe.finetune_section import FinetuneSection
from hftrain.training.trainer import HftrainTrainer, TrainerOptions

if TYPE_CHECKING:
    from hftrain.training.trainer_build import TrainerPart


def training_arguments(finetune: FinetuneSection, kwargs: dict[str, Any], seq_len: int) -> Any:
    """TrainingArguments (or the objective's subclass) from the training section's keys."""
    return BUILDERS[finetune.objective].arguments(kwargs, finetune, seq_len)


def build_trainer(part: TrainerPart, options: TrainerOptions, tokenizer_is_new: bool, **trainer: Any) -> HftrainTrainer:
    """The objective's Trainer (training/trainer_build.py gathers what it is built from); `trainer`: the Trainer's
    own arguments (model, args, processing_class, data_collator, callbacks)."""
    return BUILDERS[part.objective.name].trainer(part, options, tokenizer_is_new, **trainer)


def _lm_arguments(kwargs: dict[str, Any], finetune: FinetuneSection, seq_len: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(**kwargs)


def _dpo_arguments(kwargs: dict[str, Any], finetune: FinetuneSection, seq_len: int) -> Any:
    """TRL's DPOConfig: TrainingArguments plus finetune.dpo's keys."""
    from hftrain.training.dpo import dpo_arguments

    return dpo_arguments(kwargs, finetune.dpo, seq_len)


def _lm_trainer(part: TrainerPart, options: TrainerOptions, tokenizer_is_new: bool, **trainer: Any) -> HftrainTrainer:
    """Next-token loss on packed blocks (or instruction examples), evaluated on held-out blocks."""
    section, tokenizer = options.data.section, trainer["processing_class"]
    with phase(f"reading the validation set ({section.eval_blocks:,} blocks of {section.seq_len:,} tokens)", after_s=2):
        eval_set = validation_blocks(options.data, tokenizer)
    evaluation = TrainingEvaluation(eval_set, tokenizer, part.monitor.eval_tasks)
    return HftrainTrainer(eval_dataset=eval_set, options=replace(options, evaluation=evaluation), **trainer)


def _dpo_trainer(part: TrainerPart, options: TrainerOptions, tokenizer_is_new: bool, **trainer: Any) -> HftrainTrainer:
    """TRL's DPOTrainer behind hftrain's (training/dpo.py): its own evaluation set and collator."""
    from hftrain.training.dpo import preference_trainer

    model, args, tokenizer, callbacks = (trainer[k] for k in ("model", "args", "processing_class", "callbacks"))
    return preference_trainer(part.model, options, model, args, tokenizer, callbacks, tokenizer_is_new)


@dataclass(frozen=True)
class Builders:
    # the training section's keys -> the objective's TrainingArguments
    arguments: Callable[[dict[str, Any], FinetuneSection, int], Any]
    # (part, options, tokenizer_is_new, **the Trainer's own arguments) -> the objective's Trainer
    trainer: Callable[..., HftrainTrainer]


BUILDERS: dict[str, Builders] = {
    "lm": Builders(_lm_arguments, _lm_trainer),
    "dpo": Builders(_dpo_arguments, _dpo_trainer),
}
