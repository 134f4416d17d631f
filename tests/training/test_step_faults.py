"""hftrain's callbacks attach to a Trainer subclass hftrain did not write (TRL's trainers subclass transformers'
Trainer): the metrics file and the preemption stop work on a plain one, with nothing of HftrainTrainer."""

from __future__ import annotations

import json
import os
import signal

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hftrain.training.step_faults import PreemptionCallback
from hftrain.training.step_metrics import MetricsFileCallback


class ForeignTrainer(Trainer):
    """Stands for a third-party subclass (TRL's SFTTrainer or DPOTrainer)."""


class SignalAt(TrainerCallback):
    """Sends this process SIGUSR1 at the end of one step, as SLURM does before a preemption."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_callbacks_attach_to_a_trainer_hftrain_did_not_write(tmp_path):
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    blocks = [torch.randint(0, 64, (16,)) for _ in range(64)]
    data = [{"input_ids": ids, "labels": ids} for ids in blocks]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
    )
    preemption = PreemptionCallback()
    trainer = ForeignTrainer(
        model=GPTNeoXForCausalLM(config),
        args=args,
        train_dataset=data,
        callbacks=[SignalAt(3), preemption, MetricsFileCallback()],
    )
    try:
        trainer.train()
    finally:
        preemption.restore()
    assert preemption.received == "SIGUSR1" and preemption.step == 3 and trainer.state.global_step == 3  # not 10
    assert (tmp_path / "checkpoint-3").is_dir()  # saved at the step it stopped
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == [1, 2, 3]


class PoisonAt(TrainerCallback):
    """Makes one weight NaN before a step: its loss and gradients are then non-finite."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                model.gpt_neox.embed_in.weight[:, 0] = float("nan")


def test_the_nonfinite_guard_stops_a_trainer_hftrain_did_not_write(tmp_path):
    """Nothing feeds the guard there (no HftrainTrainer overrides): it checks the gradients itself at the public
    pre-optimizer event. Without that check this run trains its 10 steps on NaN weights and exits normally."""
    import pytest

    from hftrain.errors import HftrainError
    from hftrain.recipe.sections import FaultsSection
    from hftrain.training.step_faults import NonFiniteGuard

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    data = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 64, (16,)) for _ in range(64))]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
    )
    guard = NonFiniteGuard(FaultsSection(on_nonfinite="stop"), lambda: None)
    trainer = ForeignTrainer(
        model=GPTNeoXForCausalLM(config), args=args, train_dataset=data, callbacks=[PoisonAt(4), guard]
    )
    with pytest.raises(
        HftrainError, match=r"non-finite loss or gradient norm \(nan\) at step 4; stopped \(faults.on_nonfinite=stop\)"
    ):
        trainer.train()
    # The flag is read where the Trainer reads (here the last step: logging_steps is 500), not at each step; the
    # fused AdamW skipped every flagged step on the device meanwhile: 3 optimizer steps taken, not 10.
    assert trainer.state.global_step == 10
    assert {int(state["step"]) for state in trainer.optimizer.state.values()} == {3}
