"""The speed defaults a CUDA device decides (issue 51 part 6), on the CPU with the device's properties faked: a GPU's
compile warm-up and saving, TF32 beside bf16 where the card has it, fused AdamW, and a resumed run keeping them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import hftrain
from hftrain.speed import defaults as speed
from hftrain.speed.defaults import DeviceFacts, SpeedPart
from hftrain.speed.probe import Measurement
from hftrain.training import arguments

H100, A100, T4, CPU = (
    DeviceFacts("cuda", (9, 0)),
    DeviceFacts("cuda", (8, 0)),
    DeviceFacts("cuda", (7, 5)),
    DeviceFacts("cpu"),
)
# hftrain at pythia-160m (12 layers), 8 x 2,048 tokens, bf16, eager, on an H200: 210,865 tokens/s (notes/gpu-peers.md)
PYTHIA_160M_STEP = 8 * 2048 / 210_865


def recipe(**training):
    return hftrain.load_recipe(
        None, {"model": {"preset": "cpu-medium"}, "training": {"max_steps": 100, "output_dir": "x", **training}}
    )


@pytest.mark.parametrize(
    "device, layers, warm, seconds",
    [
        (H100, 12, False, 63.0),  # pythia-160m: 91 s compiled against 28 s eager for the same 50 steps on an H200
        (A100, 16, False, 74.0),  # pythia-1b: a minute or so, growing with the layers
        (T4, 4, False, 41.0),
        (H100, 12, True, 14.0),  # warm: the CPU's measured ratio, 20 / 90
        (CPU, 12, False, 90.0),  # the 2-core CPU's measurement, whatever the model
        (CPU, 4, True, 20.0),
    ],
)
def test_the_compile_warmup_is_the_devices(device, layers, warm, seconds):
    assert speed.compile_warmup_s(device.type, layers, warm) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "device, dtype, share",
    [
        (H100, "bf16", 0.21),
        (A100, "bf16", 0.21),
        (T4, "fp16", 0.21),
        (H100, "tf32", 0.15),
        (CPU, "bf16", 0.3),
        (CPU, "fp32", 0.0),
    ],
)
def test_the_compile_saving_is_the_devices(device, dtype, share):
    assert speed.COMPILE_SAVING[(device.type, dtype)] == share


@pytest.mark.parametrize("steps, compiled", [(5_000, False), (10_000, True)])
def test_a_gpu_run_compiles_once_its_saving_pays_a_gpu_compile_back(steps, compiled):
    """pythia-160m on an H100 at the measured eager step: 10,000 steps (13 min eager) save ~163 s against a ~63 s
    compile; 5,000 save ~82 s, less than twice the compile. With the CPU's 90 s and a 15% saving neither compiled."""
    measured = Measurement({"fp32": 4 * PYTHIA_160M_STEP, "bf16": PYTHIA_160M_STEP}, "cuda")
    plan = speed.decide(
        SpeedPart.of(recipe()), {"max_steps": steps}, "single", measured, torch.device("cuda"), False, layers=12
    )
    assert plan.values["torch_compile"] is compiled, plan.reasons
    assert f"~{speed.compile_warmup_s('cuda', 12, False):.0f} s cold compile" in plan.reasons[-1]


TF32_CASES = [  # device, keys the recipe (or the run's start) set, values so far, tf32 hftrain sets (None: leaves it)
    (H100, set(), {"bf16": True, "fp16": False, "tf32": False}, True),  # the measurement chose bf16
    (A100, set(), {"bf16": True, "fp16": False, "tf32": False}, True),
    (A100, {"bf16"}, {"bf16": True}, True),  # the recipe's bf16
    (T4, set(), {"bf16": False, "fp16": True, "tf32": False}, None),  # no TF32 below compute capability 8.0
    (T4, {"bf16"}, {"bf16": True}, None),
    (CPU, set(), {"bf16": True}, None),  # never on a CPU
    (H100, {"tf32", "bf16"}, {"bf16": True, "tf32": False}, None),  # the recipe's tf32 wins
    (H100, {"fp16"}, {"fp16": True}, None),
    (H100, set(), {"bf16": False, "fp16": False, "tf32": False}, None),  # measured: no autocast dtype pays, fp32 kept
    (H100, set(), {"bf16": False, "fp16": False, "tf32": True}, None),  # measured: tf32 as the dtype, already on
]


@pytest.mark.parametrize("device, chosen, values, tf32", TF32_CASES)
def test_tf32_beside_bf16_only_where_the_card_has_it(device, chosen, values, tf32):
    out, reasons = speed.device_levers(chosen, values, device)
    assert out.get("tf32") is tf32
    assert any(r.startswith("tf32 for the fp32 matmuls beside bf16") for r in reasons) is bool(tf32)


@pytest.mark.parametrize(
    "device, chosen, optim",
    [(H100, set(), "adamw_torch_fused"), (T4, set(), "adamw_torch_fused"), (H100, {"optim"}, None), (CPU, set(), None)],
)
def test_fused_adamw_on_cuda_where_the_recipe_leaves_optim(device, chosen, optim):
    out, reasons = speed.device_levers(chosen, {"bf16": True, "tf32": True}, device)
    assert out.get("optim") == optim
    assert any(r.startswith("optim=adamw_torch_fused (fused AdamW on CUDA") for r in reasons) is bool(optim)


def speed_defaults(monkeypatch, device, kwargs, recorded=None):
    """arguments.speed_defaults on `device`'s faked properties; the probe never runs (it would need the device)."""
    monkeypatch.setattr(speed.DeviceFacts, "of", classmethod(lambda cls, d: device))
    monkeypatch.setattr(speed, "decide_here", lambda *a: pytest.fail("nothing to measure"))
    dims = SimpleNamespace(strategy="single", rank=0, processes=1)
    given = dict(kwargs)
    plan = arguments.speed_defaults(SpeedPart.of(recipe()), kwargs, dims, None, recorded, torch.device(device.type))
    assert kwargs == given  # what it decides is returned, merged once by arguments.set_up (issue 61 part 3)
    return {**kwargs, **plan.values}, plan


def test_a_recipe_with_its_levers_set_gets_the_devices_own(monkeypatch):
    kwargs, plan = speed_defaults(monkeypatch, H100, {"max_steps": 100, "bf16": True, "torch_compile": True})
    assert (
        kwargs["tf32"] is True
        and kwargs["optim"] == "adamw_torch_fused"
        and plan.values == {"tf32": True, "optim": "adamw_torch_fused"}
    )
    kwargs, plan = speed_defaults(
        monkeypatch, H100, {"max_steps": 100, "bf16": True, "torch_compile": True, "optim": "adamw_torch"}
    )
    assert kwargs["optim"] == "adamw_torch" and "optim" not in plan.values  # the recipe's optimizer stays
    kwargs, plan = speed_defaults(monkeypatch, CPU, {"max_steps": 100, "bf16": True, "torch_compile": True})
    assert "tf32" not in kwargs and "optim" not in kwargs and plan.values == {}


def test_a_resumed_run_keeps_its_optimizer_and_tf32_where_the_card_has_it(monkeypatch):
    start = {"bf16": True, "fp16": False, "tf32": True, "torch_compile": False, "optim": "adamw_torch"}
    kwargs, plan = speed_defaults(monkeypatch, H100, {"max_steps": 100}, dict(start))
    assert {k: kwargs[k] for k in start} == start  # adamw_torch as it started, not the default for a new CUDA run
    kwargs, plan = speed_defaults(monkeypatch, T4, {"max_steps": 100}, dict(start))  # continued on a card without TF32
    assert "tf32" not in kwargs and kwargs["optim"] == "adamw_torch" and kwargs["bf16"] is True
    assert "tf32 from the run's start left unset: no TF32 on compute capability 7.5" in plan.reasons


def test_the_run_records_its_optimizer_at_its_start(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, optim="adamw_torch", report_to="none")
    dims = SimpleNamespace(global_batch=8, readers=SimpleNamespace(readers=8, window=4))
    record = arguments.start_record(args, dims)  # type: ignore[arg-type]
    assert json.loads(json.dumps(record))["speed"]["optim"] == "adamw_torch"  # the name, as JSON writes it
