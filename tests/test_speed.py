"""Speed defaults: bf16 autocast and torch.compile are chosen per run where the recipe is silent, never over it."""

from __future__ import annotations

import json

import pytest
import torch

import hftrain
from hftrain import speed
from hftrain.arguments import training_arguments
from hftrain.model import measure_model
from hftrain.parallel import Launch

from .support.checks import loss_records
from .support.data import tiny_recipe


def args_for(monkeypatch, native_bf16: bool, preset: str = "cpu-medium", max_steps: int = 100, **sections):
    monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: native_bf16)
    sections.setdefault("model", {"preset": preset})
    sections["training"] = {"max_steps": max_steps, "output_dir": "unused", **sections.get("training", {})}
    settings = settings_for(hftrain.load_recipe(None, sections))
    return settings.args, settings.speed_choices


def settings_for(recipe):
    return training_arguments(recipe, Launch("single", 1, 0, None), measure_model(recipe))


def test_bf16_on_a_cpu_with_native_bf16_where_it_was_measured_to_pay(monkeypatch):
    args, decisions = args_for(monkeypatch, True, "cpu-medium", max_steps=50)  # hidden 384, eager: 1.44x
    assert not args.torch_compile and args.bf16
    assert "bf16=on (native bf16 CPU, 30.0M matmul parameters, hidden size 384)" in decisions
    args, decisions = args_for(monkeypatch, True, "cpu-medium", max_steps=5000)  # compiled: 1.65x
    assert args.torch_compile and args.bf16 and "bf16=on (native bf16 CPU, 30.0M matmul parameters, compiled)" in decisions
    small = {"model": {"preset": "cpu-small"}, "data": {"seq_len": 64}, "training": {"per_device_train_batch_size": 12}}
    args, decisions = args_for(monkeypatch, True, max_steps=2000, **small)  # the benchmark's small shape: 1.35x
    assert args.torch_compile and args.bf16
    args, decisions = args_for(monkeypatch, True, max_steps=200, **small)  # eager bf16 would be 0.88x
    assert not args.torch_compile and not args.bf16 and "hidden size 128 < 256" in decisions[1]
    args, decisions = args_for(monkeypatch, True, "cpu-tiny")  # GPT-2's 50k-token head: 3.3M
    assert not args.bf16 and "3.3M matmul parameters < 4M" in decisions[1]
    args, decisions = args_for(monkeypatch, False, "cpu-medium")
    assert not args.bf16 and "no native bf16" in decisions[1]
    quickstart = hftrain.load_recipe("recipes/quickstart.yaml")  # 1.3M: exact fp32, eager (a 2-minute run)
    assert speed_line(monkeypatch, quickstart).startswith("torch_compile=off (a short run (~2 min eager)")
    assert "bf16=off" in speed_line(monkeypatch, quickstart)


def speed_line(monkeypatch, recipe) -> str:
    monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: True)
    return "; ".join(settings_for(recipe).speed_choices)


def test_the_recipe_always_wins(monkeypatch):
    args, decisions = args_for(monkeypatch, True, "cpu-medium", training={"bf16": False, "torch_compile": False}, max_steps=10**6)
    assert not args.bf16 and not args.torch_compile and decisions == []
    args, decisions = args_for(monkeypatch, False, "cpu-tiny", training={"bf16": True})
    assert args.bf16 and all(not d.startswith("bf16") for d in decisions)


def test_compile_only_for_long_full_training_runs(monkeypatch):
    short, _ = args_for(monkeypatch, True, "cpu-medium", max_steps=50)
    long, decisions = args_for(monkeypatch, True, "cpu-medium", max_steps=20_000)
    assert not short.torch_compile and long.torch_compile and "compile pays back" in decisions[0]
    recipe = hftrain.load_recipe(None, {"model": {"preset": "cpu-medium"}, "training": {"max_steps": 20_000, "output_dir": "x"}})
    for strategy in ("fsdp", "zero3", "device_map"):
        kwargs = {"max_steps": 20_000, "per_device_train_batch_size": 8}
        speed.apply_defaults(recipe, kwargs, strategy, {"matmul_params": 30_000_000, "hidden_size": 384}, 1e14, torch.device("cpu"))
        assert kwargs["torch_compile"] is False, strategy
    lora = hftrain.load_recipe(None, {"model": {"from_pretrained": "x"}, "finetune": {"method": "lora"}, "training": {"max_steps": 20_000}})
    assert speed.choose_compile(lora, {}, "single", 10**6)[0] is False
    assert speed.choose_compile(recipe, {"gradient_checkpointing": True}, "single", 10**6)[0] is False


def test_quantized_fine_tuning_keeps_its_compute_dtype():
    recipe = hftrain.load_recipe(None, {"model": {"from_pretrained": "x"}, "finetune": {"method": "qlora"}})
    model = {"matmul_params": 10**9, "hidden_size": 4096}
    assert speed.choose_bf16(recipe, model, False, torch.device("cpu")) == (False, "quantized fine-tuning uses its own compute dtype")


def test_the_run_says_what_it_chose(make_recipe, capsys):
    run = hftrain.train(make_recipe(max_steps=3, save_steps=100))
    out = capsys.readouterr().out
    assert "hftrain: speed defaults: torch_compile=off (a short run" in out and "; bf16=off (" in out
    results = json.loads((run.output_dir / "results.json").read_text())
    assert results["bf16"] is False and results["torch_compile"] is False


@pytest.mark.slow
def test_compiled_training_learns_like_eager_and_saves_a_plain_checkpoint(corpus, tmp_path):
    """torch.compile is a default for long runs: it must train the same model and save standard weights."""
    def run(name: str, compile: bool):
        raw = tiny_recipe(corpus, tmp_path / name, max_steps=12, save_steps=6, torch_compile=compile)
        return hftrain.train(hftrain.load_recipe(None, raw))

    eager, compiled = run("eager", False), run("compiled", True)
    loss = lambda run: [e["loss"] for e in loss_records(run.log_history)]  # noqa: E731
    assert loss(compiled) == pytest.approx(loss(eager), rel=2e-3)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for checkpoint in (compiled.final_dir, compiled.output_dir / "checkpoint-6"):
        assert not [k for k in load_file(checkpoint / "model.safetensors") if "_orig_mod" in k]
    model = AutoModelForCausalLM.from_pretrained(compiled.final_dir)
    assert json.loads((compiled.final_dir / "config.json").read_text())["model_type"] == "gpt_neox"
    assert model.num_parameters() == eager.trainer.model.num_parameters()
