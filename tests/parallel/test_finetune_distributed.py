"""Fine-tuning methods x multi-process backends, each really run with 2 gloo processes; the combinations
bitsandbytes cannot run are refused before any process starts. Plus plan's memory per method."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import safetensors.torch
import torch

from hftrain.checkpoint.layout import RunLayout
from hftrain.errors import HftrainError
from hftrain.model import finetune
from hftrain.model.part import ModelPart
from hftrain.parallel.batch import BatchPart
from hftrain.parallel.dims import LaunchEnv, resolve_strategy
from hftrain.parallel.dims import resolve as resolve_dims
from hftrain.recipe.load import load_recipe

from ..support.checks import loss_records, read_metrics
from ..support.cli import EXPECTED_TYPE, in_process, launch, run_in_process, selected_params
from ..support.data import finetune_recipe
from ..support.reference_runs import finetune_recipe_file

WORKING = [
    ("lora", "ddp"),
    ("lora", "fsdp"),
    ("lora", "zero3"),
    ("qlora", "ddp"),
    ("qlora", "fsdp"),
    ("lora_8bit", "ddp"),
]


# Launched with backend_probe's Inspector, shared with test_backend_checks.py's checks of the quantized layers
# (reference_runs.finetune_probe); the LoRA ones through hftrain's own launcher, as the README's line runs them.
PROBED = {("qlora", "ddp"), ("qlora", "fsdp"), ("lora_8bit", "ddp")}


@pytest.fixture(scope="module")
def method_runs(pretrained_run, finetune_probe, tmp_path_factory, request):
    """(method, backend) -> the folder of its 2-process run (`out` inside). The combinations this session selected
    are launched at the first test's request, two at a time: a launch leaves a core idle while its launcher and
    ranks import, which the other fills (results are checked, never timings)."""
    root = tmp_path_factory.mktemp("methods")
    chosen = [
        p
        for p in selected_params(request, "test_method_trains_on_2_processes")
        if (p["method"], p["backend"]) not in PROBED
    ]
    pool, started = ThreadPoolExecutor(max_workers=2, thread_name_prefix="method_runs"), {}
    for params in chosen:
        folder = root / f"{params['method']}-{params['backend']}"
        folder.mkdir()
        recipe = finetune_recipe_file(pretrained_run.final_dir, folder, params["method"])
        started[params["method"], params["backend"]] = pool.submit(launch, recipe, params["backend"], folder / "out")
    pool.shutdown(wait=False)

    def get(method: str, backend: str):
        if (method, backend) in PROBED:
            return finetune_probe(method, backend)[1]
        started[method, backend].result()
        return root / f"{method}-{backend}"

    return get


@pytest.mark.slow
@pytest.mark.parametrize("method, backend", WORKING)
def test_method_trains_on_2_processes(pretrained_run, method_runs, method, backend, capsys):
    tmp_path = method_runs(method, backend)
    out = tmp_path / "out"
    results = json.loads(RunLayout(out).results.read_text())
    assert (results["distributed_type"], results["world_size"]) == (EXPECTED_TYPE[backend], 2)  # really distributed

    log = read_metrics(out)
    losses = [e["loss"] for e in loss_records(log)]
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert results["eval_loss"] < evals[0]  # held-out answer loss falls from the base model's

    adapter = safetensors.torch.load_file(RunLayout(out).final / "adapter" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    # gathered whole, and trained (B starts at 0)
    assert lora_b and all(t.ndim == 2 and t.abs().sum() > 0 for t in lora_b)

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(RunLayout(out).final).eval()  # the merged standard model
    base = AutoModelForCausalLM.from_pretrained(pretrained_run.final_dir).eval()
    ids = torch.arange(1, 20).unsqueeze(0)
    with torch.no_grad():
        logits = merged(ids).logits
        assert torch.isfinite(logits).all() and not torch.allclose(logits, base(ids).logits)
    if backend == "fsdp":  # its checkpoints hold the adapter sharded: export consolidates and merges it
        code, printed = in_process(
            capsys, "export", str(out / "checkpoint-6"), "--merge", "--out", str(tmp_path / "exported")
        )
        assert code == 0, printed[-3000:]
        with torch.no_grad():
            torch.testing.assert_close(
                AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(ids).logits, logits
            )


@pytest.mark.slow
def test_quantized_zero3_is_refused_before_any_process_starts(pretrained_run, tmp_path, capsys):
    code, printed = in_process(
        capsys,
        "train",
        str(finetune_recipe_file(pretrained_run.final_dir, tmp_path, "qlora")),
        "--accelerate-config",
        "zero3",
        "--nproc",
        "2",
    )
    assert code == 2 and "Traceback" not in printed
    assert (
        "hftrain: error: finetune.method=qlora with "
        "parallelism.strategy=zero3 (ZeRO-3): not supported. DeepSpeed ZeRO-3 "
        "partitions weights as the model is built (zero.Init), which does not support bitsandbytes' quantized weights"
    ) in printed
    assert not (tmp_path / "qlora").exists()  # nothing was started


def test_quantized_combinations_bitsandbytes_cannot_run(pretrained_run, tmp_path):
    raw = finetune_recipe(pretrained_run.final_dir, tmp_path, "lora_8bit")
    with pytest.raises(
        HftrainError,
        match=(
            r"finetune.method=lora_8bit with parallelism.strategy=fsdp \(FSDP\): FSDP cannot shard bitsandbytes' int8"
        ),
    ):
        finetune.check_strategy(ModelPart.of(load_recipe(None, raw)), "fsdp")
    raw["finetune"].update(
        method="qlora", quantization={"bnb_4bit_quant_storage": "uint8", "bnb_4bit_compute_dtype": "bfloat16"}
    )
    recipe = load_recipe(None, raw)
    with pytest.raises(
        HftrainError,
        match="bnb_4bit_quant_storage: uint8 with FSDP; FSDP shards the 4-bit weights only when .* set it to bfloat16",
    ):
        finetune.check_strategy(ModelPart.of(recipe), "fsdp")
    assert finetune.check_strategy(ModelPart.of(recipe), "ddp") == "uint8"
    raw["finetune"]["quantization"].pop("bnb_4bit_quant_storage")
    # defaults to the compute dtype
    assert finetune.check_strategy(ModelPart.of(load_recipe(None, raw)), "fsdp") == "bfloat16"


def test_each_rank_loads_the_quantized_model_onto_its_own_gpu(pretrained_run, tmp_path, monkeypatch):
    recipe = load_recipe(None, finetune_recipe(pretrained_run.final_dir, tmp_path, "qlora"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    launch = LaunchEnv.read()  # the run's dims, resolved once from the launcher's environment
    dims = resolve_dims(launch, resolve_strategy("auto", launch), BatchPart.of(recipe), recipe.data)
    assert finetune.quantized_device_map(ModelPart.of(recipe), dims) is None  # CPU: nothing to choose
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # not cuda:0 (transformers#21736)
    assert finetune.quantized_device_map(ModelPart.of(recipe), dims) == {"": torch.device("cuda", 1)}


def test_adapter_init_is_the_same_in_every_run_and_on_every_rank(pretrained_run, tmp_path):
    """FSDP and ZeRO-3 keep each rank's own part of the adapter: an unseeded init made runs differ by backend."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(None, finetune_recipe(pretrained_run.final_dir, tmp_path, "lora"))
    inits = []
    for _ in range(2):
        torch.rand(7)  # whatever ran before (imports, data, launch code) must not matter
        model = finetune.apply_method(
            AutoModelForCausalLM.from_pretrained(pretrained_run.final_dir), ModelPart.of(recipe), False
        )
        inits.append({k: v.clone() for k, v in model.state_dict().items() if "lora_A" in k})
    assert inits[0] and all(torch.equal(inits[0][k], inits[1][k]) for k in inits[0])


def test_plan_reports_memory_per_finetune_method():
    result = run_in_process("plan", "recipes/pretrain/pythia-160m.yaml", "finetune.method=lora")
    assert result.returncode == 0, result.stderr
    table = {
        line.split()[0]: line
        for line in result.stdout.splitlines()
        if line.startswith("  ") and line.split()[0] in METHODS and "4-bit" not in line
    }
    assert set(table) == set(METHODS) and table["lora"].endswith("<- this recipe")
    # weights, gradients, optimizer, total
    gb = {m: [float(w) for w in line.split()[2:10:2]] for m, line in table.items()}
    assert gb["full"] == [0.65, 0.65, 1.30, 2.60]  # 162M parameters: fp32 weights and gradients, two fp32 AdamW moments
    assert gb["lora"][0] >= gb["full"][0] and gb["lora"][1] <= 0.01  # frozen fp32 base; gradients for the adapter only
    assert gb["qlora"][0] < gb["lora_8bit"][0] < gb["lora"][0]
    assert gb["qlora"][3] < gb["full"][3] / 5
    assert "qlora 4-bit weights / bf16: 0.258 for the 84,934,656 quantized linear weights" in result.stdout


METHODS = ("full", "lora", "qlora", "lora_8bit")
