"""speed.fp8 (speed/fp8.py): its refusals, one line each, on a faked device; the layers it converts in Pythia's
shapes, as numbers (no torchao needed); the recipe key; torch.compile turned on for it; `hftrain plan`'s
lines; and, where torchao is installed, a converted model whose checkpoint plain transformers loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml

import hftrain
from hftrain.errors import HftrainError
from hftrain.model import float8
from hftrain.model.part import ModelPart
from hftrain.model.shape import measure_model, of_module
from hftrain.planning.estimates import format_fp8
from hftrain.speed import defaults as speed
from hftrain.speed import fp8
from hftrain.speed.defaults import DeviceFacts, SpeedPart
from hftrain.training import arguments

from ..support.cli import in_process
from ..support.data import make_documents, tiny_recipe, write_jsonl

LINEARS = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
H100, ADA, A100, CPU = (
    DeviceFacts("cuda", (9, 0)),
    DeviceFacts("cuda", (8, 9)),
    DeviceFacts("cuda", (8, 0)),
    DeviceFacts("cpu"),
)


def shape_of(preset: str, **model):
    """The preset's model as hftrain measures it (model/shape.py)."""
    recipe = hftrain.load_recipe(
        None, {"model": {"preset": preset, **model}, "training": {"max_steps": 10, "output_dir": "x"}}
    )
    return measure_model(ModelPart.of(recipe))


def fp8_run(**change):
    """check()'s arguments for a run it lets through (an H100, compile left to hftrain, full training, one
    process, pythia-160m), with `change` applied."""
    return {
        "fp8": "tensorwise",
        "device": H100,
        "card": "NVIDIA H100 80GB HBM3",
        "recipe_kwargs": {"max_steps": 100},
        "method": "full",
        "strategy": "single",
        "shape": shape_of("pythia-160m"),
        "installed": True,
        **change,
    }


REFUSED = [
    ("on a CPU", {"device": CPU, "card": ""}, "needs a CUDA GPU with FP8 (compute capability 8.9 or newer"),
    (
        "a card without FP8",
        {"device": A100, "card": "NVIDIA A100-SXM4-80GB"},
        "NVIDIA A100-SXM4-80GB has compute capability 8.0",
    ),
    ("compile off", {"recipe_kwargs": {"torch_compile": False}}, "the recipe sets training.torch_compile: false"),
    ("lora", {"method": "lora"}, "not finetune.method: lora"),
    ("qlora", {"method": "qlora"}, "not finetune.method: qlora"),
    ("zero3", {"strategy": "zero3"}, "parallelism.strategy=zero3: not supported"),
    ("nothing to convert", {"shape": shape_of("cpu-tiny")}, "no linear layer of this model converts"),
    ("no torchao", {"installed": False}, "pip install 'hftrain[fp8]'"),
]


@pytest.mark.parametrize("name, change, expected", REFUSED, ids=[r[0] for r in REFUSED])
def test_fp8_is_refused_in_one_line_naming_the_key(name, change, expected):
    with pytest.raises(HftrainError) as refused:
        fp8.check(**fp8_run(**change))
    message = str(refused.value)
    assert message.startswith("speed.fp8: tensorwise") and "\n" not in message, message
    assert expected in message, message


@pytest.mark.parametrize(
    "change",
    [
        {},  # an H100, compile left to hftrain
        # Ada, FSDP2
        {"device": ADA, "card": "NVIDIA L4", "recipe_kwargs": {"torch_compile": True}, "strategy": "fsdp"},
        {"fp8": None, "device": CPU, "method": "lora", "strategy": "zero3", "installed": False},  # off: nothing checked
    ],
    ids=["h100", "ada-fsdp", "off"],
)
def test_each_check_lets_a_run_that_can_train_through(change):
    fp8.check(**fp8_run(**change))


def test_the_run_checks_the_device_it_trains_on(tmp_path, capsys):
    """check_here reads the device; `hftrain train` on this CPU is refused in one line before its output directory
    is made or its speed probe measures anything."""
    with pytest.raises(HftrainError, match=r"^speed\.fp8: rowwise needs a CUDA GPU .* trains on the CPU"):
        fp8.check_here("rowwise", torch.device("cpu"), {}, "full", "single", None)
    recipe = tmp_path / "r.yaml"
    data = write_jsonl(tmp_path / "good.jsonl", make_documents(50))
    # the probe would measure
    recipe.write_text(yaml.safe_dump(tiny_recipe(data, tmp_path / "run", measured_speed=True)))
    code, printed = in_process(capsys, "train", str(recipe), "speed.fp8=tensorwise", "model.preset=pythia-14m")
    refusal = "hftrain: error: speed.fp8: tensorwise needs a CUDA GPU with FP8"
    assert code == 2 and printed.strip().splitlines()[-1].startswith(refusal), printed[-2000:]
    assert "measuring" not in printed and not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset, blocks", [("pythia-160m", 12), ("pythia-1b", 16)])
def test_the_filter_keeps_the_head_and_the_end_blocks_of_pythia(preset, blocks):
    model = shape_of(preset)
    expected = {f"gpt_neox.layers.{i}.{linear}" for i in range(1, blocks - 1) for linear in LINEARS}
    assert set(float8.converted(model)) == expected and len(expected) == 4 * (blocks - 2)
    choice = float8.layer_choice(model)
    assert choice["lm_head"] == "the output head"
    assert all(choice[f"gpt_neox.layers.{i}.{linear}"] for i in (0, blocks - 1) for linear in LINEARS)
    assert len(choice) == 4 * blocks + 1  # every Linear is named, converted or not


def test_the_filter_leaves_dims_not_multiples_of_16():
    """An MLP 200 wide: its two linears stay in high precision, the attention's convert."""
    model = shape_of("cpu-small", intermediate_size=200)
    assert set(float8.converted(model)) == {
        f"gpt_neox.layers.{i}.attention.{n}" for i in (1, 2) for n in ("query_key_value", "dense")
    }
    assert (
        float8.layer_choice(model)["gpt_neox.layers.1.mlp.dense_h_to_4h"] == "in or out features not a multiple of 16"
    )


def test_the_recipe_key_takes_the_two_recipes_only(tmp_path, capsys):
    assert hftrain.load_recipe(None, {"speed": {"fp8": "tensorwise"}}).speed.fp8 == "tensorwise"
    assert hftrain.load_recipe(None, {}).speed.fp8 is None
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_recipe(write_jsonl(tmp_path / "good.jsonl", make_documents(50)), tmp_path / "run"))
    )
    code, printed = in_process(capsys, "plan", str(recipe), "speed.fp8=fp4")
    assert code == 2 and "Traceback" not in printed
    assert "speed.fp8: Input should be 'tensorwise' or 'rowwise'" in printed, printed[-2000:]


def test_fp8_turns_compile_on_where_the_recipe_leaves_it(monkeypatch, tmp_path):
    """The speed levers' set-up (training/arguments.py) on a faked H100: torch_compile on, with its reason."""
    assert fp8.compile_for("rowwise", {"torch_compile": True}) == ({}, []) and fp8.compile_for(None, {}) == ({}, [])
    monkeypatch.setattr(speed.DeviceFacts, "of", classmethod(lambda cls, d: H100))
    monkeypatch.setattr(speed, "decide_here", lambda *a: pytest.fail("bf16 and compile are set: nothing to measure"))
    monkeypatch.setattr(arguments._compat, "keep_freed_memory", lambda device: None)
    # an H100's
    monkeypatch.setattr(arguments, "training_arguments", lambda values, finetune, seq_len: SimpleNamespace(**values))
    dims = SimpleNamespace(strategy="single", rank=0, processes=1, nodes=1, local_rank=0)
    part = SpeedPart(
        method="full", seq_len=128, section=hftrain.load_recipe(None, {"speed": {"fp8": "tensorwise"}}).speed
    )
    monkeypatch.setattr(arguments.fp8, "check_here", lambda *a: None)  # a CPU machine: its refusal is tested above
    monkeypatch.setattr(arguments.fp8, "note", lambda shape, setting: f"fp8 {setting}")
    model = ModelPart.of(hftrain.load_recipe(None, {}))
    args, plan = arguments.set_up({"max_steps": 100, "bf16": True}, dims, None, part, model, {}, tmp_path)
    assert args.torch_compile is True and plan.values["torch_compile"] is True
    assert plan.reasons[0] == "torch_compile=on (speed.fp8: tensorwise needs it to fuse the FP8 casts)"


def test_plan_says_which_layers_convert_and_what_to_expect():
    small = {"shape": {"hidden": 768}, "fp8_layers": fp8.summary(shape_of("pythia-160m"))}
    lines = format_fp8(small, "tensorwise", card_has_fp8=True)
    assert lines[0].startswith(
        "fp8 (tensorwise, torchao): 40 of 49 linear layers in FP8 matmuls, in blocks 1-10 of 0-11"
    )
    assert "FP8 may be slower than bf16" in lines[1] and "Llama-3-8B +25%" in lines[1] and len(lines) == 2
    assert "refuses speed.fp8 here" in format_fp8(small, "tensorwise", card_has_fp8=False)[-1]
    wide = {"shape": {"hidden": 4096}, "fp8_layers": small["fp8_layers"]}
    assert "wide enough for FP8 to pay" in format_fp8(wide, "rowwise", card_has_fp8=True)[1]
    assert format_fp8(wide, None, card_has_fp8=True)[0].startswith(
        "fp8: off; at hidden 4,096 speed.fp8: tensorwise may train faster"
    )
    assert format_fp8(wide, None, card_has_fp8=False) == [] and format_fp8(small, None, card_has_fp8=True) == []


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_a_converted_model_trains_and_saves_weights_plain_transformers_loads(tmp_path, scaling):
    """torchao's Float8Linear keeps the weight as a plain parameter under nn.Linear's name: the state dict, and so
    the saved safetensors, are the model's own. Converted, one step on this CPU, saved, loaded without hftrain."""
    pytest.importorskip("torchao.float8")
    import torch._inductor.config as inductor
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=96
    )
    model = AutoModelForCausalLM.from_config(config)
    names = list(model.state_dict())
    with inductor.patch(emulate_precision_casts=False):  # rowwise turns it on for the process (torchtitan's workaround)
        float8.apply(model, scaling)
        assert inductor.emulate_precision_casts is (scaling == "rowwise")
    swapped = {name: module for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert set(swapped) == set(float8.converted(of_module(model, seq_len=16))) and len(swapped) == 8
    assert all(module.config == Float8LinearConfig.from_recipe_name(scaling) for module in swapped.values())
    assert list(model.state_dict()) == names and all(type(p) is torch.nn.Parameter for p in model.parameters())
    tokens = torch.randint(0, 96, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, Float8Linear) for m in loaded.modules())
    trained, back = model.state_dict(), loaded.state_dict()
    assert set(back) == set(trained) and all(torch.equal(back[k], trained[k]) for k in trained)
