"""DPO through TRL on hftrain's path: one full fine-tuning run on the shipped pairs (a frozen copy of the start as
the reference), checked many ways (the first five steps' losses against a plain TRL DPOTrainer on the same pairs,
rewards and held-out preference rising, an exact resume, an export that plain transformers loads and that prefers the
chosen answers more often than the base); and a short QLoRA run (the adapter disabled as the reference, merged).
Backends, kill -9, trackers and the Hub: test_preference_backends.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import hftrain
from hftrain.eval.preference_accuracy import preference_accuracy
from hftrain.integrations.publish import PublishPart
from hftrain.recipe.load import load_recipe

from ..support.cli import in_process

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[2] / "recipes" / "finetune" / "data"
PAIRS = 80  # the questions the shipped held-out pairs ask again
STEPS_VS_TRL = 5  # steps compared with a plain TRL DPOTrainer


def dpo_recipe(base, data, out, **training):
    return {
        "model": {"from_pretrained": str(base)},
        "tokenizer": {"path": str(base)},
        # in file order: TRL sees the same batch
        "data": {
            "train": {"path": str(data), "format": "preference"},
            "validation": {"path": str(SHIPPED / "preference_validation.jsonl"), "format": "preference"},
            "seq_len": 192,
            "eval_blocks": PAIRS,
            "readers": 1,
            "shuffle_window": 1,
        },
        "finetune": {
            "objective": "dpo",
            "method": "full",
            "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
            "dpo": {"beta": 0.1},
        },
        "training": {
            "output_dir": str(out),
            "max_steps": 40,
            "per_device_train_batch_size": 8,
            "learning_rate": 1e-3,
            "warmup_steps": 0,
            "logging_steps": 1,
            "save_steps": 20,
            "eval_strategy": "steps",
            "eval_steps": 20,
            "eval_on_start": True,
            "report_to": "none",
            "disable_tqdm": True,
            "bf16": False,
            "torch_compile": False,
            "seed": 7,
            **training,
        },
        "monitor": {"peak_tflops": 0.1, "plot": False, "sample_max_new_tokens": 0},
    }


@pytest.fixture(scope="module")
def dpo(docs_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    data = root / "pairs.jsonl"
    data.write_text("".join((SHIPPED / "preference_train.jsonl").read_text().splitlines(keepends=True)[:PAIRS]))
    raw = dpo_recipe(docs_model, data, root / "run")
    run = hftrain.train(load_recipe(None, raw))
    return run, raw, root


def losses(history, start=0):
    return {e["step"]: e["loss"] for e in history if "loss" in e and "eval_loss" not in e and e["step"] > start}


def test_dpo_rewards_and_held_out_preference_rise(dpo, docs_model):
    run, _, _ = dpo
    evals = [e for e in run.log_history if "eval_rewards/margins" in e]
    first, last = evals[0], evals[-1]
    # measured: margin 0 -> 1.00, preference accuracy 0.46 -> 0.54 (held-out pairs: the questions against new answers)
    assert first["eval_rewards/margins"] == 0 and last["eval_rewards/margins"] > 0.5, (first, last)
    assert last["eval_rewards/accuracies"] >= 0.65
    assert last["eval_preference_accuracy"] >= first["eval_preference_accuracy"] + 0.05, (first, last)
    line = next(e for e in run.log_history if "tokens_per_s" in e)
    assert line["tokens_per_s"] > 0 and 0 < line["mfu"] and "data_wait_frac" in line
    results = json.loads((run.output_dir / "results.json").read_text())
    assert results["eval_preference_accuracy"] == last["eval_preference_accuracy"]
    card = hftrain.integrations.hub.model_card(
        PublishPart.of(hftrain.load_recipe(run.recipe_file)), results, "me/dpo", False
    )
    assert (
        "Training method: DPO (Direct Preference Optimization, TRL's "
        "DPOTrainer, beta 0.1) on preference pairs, all weights" in card
    )
    assert (run.output_dir / "checkpoint-20" / "model.safetensors").is_file()
    assert run.trainer.ref_model is not None and not any(p.requires_grad for p in run.trainer.ref_model.parameters())


def test_the_steps_are_plain_trls(dpo, docs_model):
    """The same pairs in the same order through TRL's own DPOTrainer (its own tokenization, collator, loss and
    optimizer step) give the same losses, step after step: the integration adds nothing to the objective."""
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    run, raw, root = dpo
    records = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()[: 8 * STEPS_VS_TRL]]

    class InFileOrder(DPOTrainer):  # hftrain's run reads the pairs in file order (one reader, no shuffle window)
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    class StopEarly(TrainerCallback):  # the same 40-step learning-rate schedule, compared over its first steps
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= STEPS_VS_TRL

    # hftrain's training defaults
    args = DPOConfig(
        str(root / "trl"),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        max_steps=40,
        logging_steps=1,
        beta=0.1,
        max_length=192,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=7,
        disable_tqdm=True,
        save_strategy="no",
        warmup_steps=0,
        adam_beta2=0.95,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
    )
    trainer = InFileOrder(
        model=AutoModelForCausalLM.from_pretrained(docs_model, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(docs_model),
        callbacks=[StopEarly()],
    )
    trainer.train()
    plain, ours = losses(trainer.state.log_history), losses(run.log_history)
    assert sorted(plain) == list(range(1, STEPS_VS_TRL + 1))
    diffs = {step: abs(ours[step] - plain[step]) for step in plain}
    print("per-step |hftrain - TRL| DPO loss:", {s: f"{d:.2g}" for s, d in diffs.items()})
    assert max(diffs.values()) < 1e-6, (ours, plain)  # measured: 0 at every step
    assert plain[STEPS_VS_TRL] < plain[1] - 0.03  # the steps compared did train
    first = next(e for e in trainer.state.log_history if e.get("step") == 1 and "loss" in e)
    mine = next(e for e in run.log_history if e.get("step") == 1 and "loss" in e)
    assert abs(mine["logps/chosen"] - first["logps/chosen"]) < 1e-3 * abs(first["logps/chosen"])


def test_the_report_charts_the_rewards(dpo):
    from hftrain.eval.report import write_report

    run, _, _ = dpo
    page = write_report(run.output_dir).read_text()
    for chart in ("chart-loss", "chart-reward-margin", "chart-reward-accuracy", "chart-tokens-per-s"):
        assert f'id="{chart}"' in page, chart  # an id is written only for a chart that was drawn


def test_a_non_finite_dpo_loss_stops_the_run_at_once(dpo, tmp_path, monkeypatch):
    """The non-finite guard sees TRL's loss: a NaN at step 3 stops the run and names the last good checkpoint."""
    import torch
    from trl import DPOTrainer

    from hftrain.errors import HftrainError

    _, raw, _ = dpo
    real, calls = DPOTrainer.compute_loss, {"n": 0}

    def poisoned(self, model, inputs, *args, **kwargs):
        out = real(self, model, inputs, *args, **kwargs)
        if model.training:
            calls["n"] += 1
            if calls["n"] == 3:  # the third training step's loss
                nan = torch.tensor(float("nan"))
                return (out[0] * nan, *out[1:]) if isinstance(out, tuple) else out * nan
        return out

    monkeypatch.setattr(DPOTrainer, "compute_loss", poisoned)
    run_dir = tmp_path / "nan"
    stopped = {
        **raw,
        "faults": {"on_nonfinite": "stop"},
        "training": {
            **raw["training"],
            "output_dir": str(run_dir),
            "max_steps": 4,
            "save_steps": 2,
            "eval_strategy": "no",
        },
    }
    with pytest.raises(HftrainError) as info:
        hftrain.train(load_recipe(None, stopped))
    assert "non-finite loss or gradient norm (nan) at step 3; stopped (faults.on_nonfinite=stop)" in str(info.value)
    assert f"the last good checkpoint is {run_dir / 'checkpoint-2'}" in str(info.value)


def test_a_resumed_dpo_run_continues_exactly(dpo, tmp_path):
    run, raw, root = dpo
    copy = tmp_path / "run"
    shutil.copytree(run.output_dir, copy, ignore=shutil.ignore_patterns("checkpoint-40", "final", "results.json"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line).get("step", 0) <= 20))
    resumed = hftrain.train(load_recipe(None, {**raw, "training": {**raw["training"], "output_dir": str(copy)}}))
    expected, got = losses(run.log_history, 20), losses(resumed.log_history, 20)
    assert got.keys() == expected.keys() == set(range(21, 41))
    assert all(abs(got[s] - expected[s]) < 1e-5 for s in got), (got, expected)


def test_the_export_prefers_chosen_answers_in_plain_transformers(dpo, docs_model, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, _, _ = dpo
    out = tmp_path / "exported"
    code, printed = in_process(capsys, "export", str(run.output_dir / "checkpoint-40"), "--out", str(out))
    assert code == 0, printed[-2000:]
    held_out = [json.loads(line) for line in (SHIPPED / "preference_validation.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(out)
    merged = preference_accuracy(AutoModelForCausalLM.from_pretrained(out), tokenizer, held_out)
    before = preference_accuracy(AutoModelForCausalLM.from_pretrained(docs_model), tokenizer, held_out)
    assert merged >= before + 0.05, (before, merged)
    assert (
        json.loads((out / "config.json").read_text())["model_type"] == "gpt_neox"
        and (out / "model.safetensors").is_file()
    )


def test_qlora_dpo_disables_the_adapter_for_its_reference_and_merges(docs_model, dpo, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, raw, root = dpo
    qlora = {
        **raw,
        "finetune": {**raw["finetune"], "method": "qlora"},
        "training": {
            **raw["training"],
            "output_dir": str(tmp_path / "qlora"),
            "max_steps": 4,
            "save_steps": 4,
            "eval_strategy": "no",
            "learning_rate": 3e-3,
        },
    }
    run = hftrain.train(load_recipe(None, qlora))
    model = run.trainer.model
    assert isinstance(model, PeftModel) and run.trainer.ref_model is None and list(model.peft_config) == ["default"]
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())  # the base is 4-bit; no second copy exists
    assert (
        sum(p.numel() for p in model.parameters() if p.requires_grad) < sum(p.numel() for p in model.parameters()) / 4
    )
    assert (tmp_path / "qlora" / "checkpoint-4" / "adapter_model.safetensors").is_file()
    # the adapter moved off the base
    assert next(e for e in run.log_history if e.get("step") == 4)["rewards/margins"] != 0
    merged = AutoModelForCausalLM.from_pretrained(run.final_dir)  # final/: the merged standard model
    assert merged.config.model_type == "gpt_neox" and not hasattr(merged, "peft_config")
