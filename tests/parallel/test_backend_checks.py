"""The backends and quantized methods verified on the thing itself, not on accelerate's word for it: FSDP
parameters are DTensors holding their shard, ZeRO-3 parameters are partitioned, both checkpoint per-rank shards,
QLoRA and 8-bit LoRA hold bitsandbytes layers with packed weights. Every check is also run against the silent
fallback (the same recipe under DDP, an unquantized model, a doctored observation) and must reject it.

One 2-step run per backend, shared by the tests of this module, and the 2-process fine-tuning runs that
test_finetune_distributed.py checks too (reference_runs.finetune_probe); backend_probe.py, backend_checks.py.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

import hftrain
from hftrain.checkpoint.layout import RunLayout

from ..support.backend_checks import (
    NotWhatWasAsked,
    check_fsdp,
    check_fsdp_checkpoint,
    check_quantized,
    check_zero3,
    check_zero3_checkpoint,
    shard_rows,
)
from ..support.backend_probe import Inspector, load_observations, run_probe
from ..support.data import finetune_recipe, make_documents, tiny_recipe, write_jsonl

STEPS = 2


class Runs:
    """Each (method, backend) trained once, on first use: the observations of every rank and the output dir."""

    def __init__(self, root: Path, base: Path, finetune_probe) -> None:
        self.root, self.base, self.done, self.finetune_probe = root, base, {}, finetune_probe
        self.data = write_jsonl(root / "train.jsonl", make_documents(300))

    def recipe(self, method: str, backend: str) -> dict[str, Any]:
        out = self.root / f"{method}-{backend}"
        common = {"max_steps": STEPS, "save_steps": STEPS, "logging_steps": 1}
        if method == "pretrain":
            raw = tiny_recipe(self.data, out / "run", **common)
        else:
            out.mkdir(parents=True, exist_ok=True)
            raw = finetune_recipe(self.base, out, method, eval_on_start=False, **common)
            raw["training"]["output_dir"] = str(out / "run")
        raw["monitor"]["sample_max_new_tokens"] = 0
        return raw

    def get(self, method: str, backend: str) -> tuple[list[dict[str, Any]], Path]:
        if (
            method != "pretrain" and backend != "single"
        ):  # the 2-process fine-tuning runs test_finetune_distributed checks too
            observations, folder = self.finetune_probe(method, backend)
            return observations, folder / "out"
        if (method, backend) not in self.done:
            raw = self.recipe(method, backend)
            out, probe = Path(raw["training"]["output_dir"]), self.root / f"{method}-{backend}" / "probe"
            if backend == "single":  # in this process: nothing to launch
                hftrain.train(hftrain.load_recipe(None, raw), callbacks=[Inspector(probe)])
                observations = load_observations(probe)
            else:
                recipe_file = self.root / f"{method}-{backend}.yaml"
                recipe_file.write_text(yaml.safe_dump(raw), encoding="utf-8")
                observations = run_probe(recipe_file, probe, backend)
            self.done[method, backend] = (observations, out)
        return self.done[method, backend]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pretrained_run, finetune_probe) -> Runs:
    return Runs(tmp_path_factory.mktemp("backend-checks"), pretrained_run.final_dir, finetune_probe)


def results(out: Path) -> dict[str, Any]:
    return json.loads(RunLayout(out).results.read_text())


def checkpoint(out: Path) -> Path:
    return out / f"checkpoint-{STEPS}"


# ------------------------------------------------------------------------------------------------ FSDP
@pytest.mark.slow
def test_fsdp_parameters_are_dtensor_shards_of_exact_size(runs):
    observations, out = runs.get("pretrain", "fsdp")
    assert (results(out)["distributed_type"], results(out)["world_size"]) == ("FSDP", 2)
    for when in ("train_begin", "step_end"):
        summary = check_fsdp(observations, world=2, when=when)
        assert summary["params"] > 20 and sum(summary["local_numel"]) == summary["full_numel"]
        # about half each
        assert abs(summary["local_numel"][0] - summary["local_numel"][1]) < 0.02 * summary["full_numel"]
    embed = observations[1]["step_end"]["params"]["gpt_neox.embed_in.weight"]
    assert embed["dtensor"]["local_shape"] == [embed["shape"][0] // 2, embed["shape"][1]]  # e.g. [192, 64] of [384, 64]


@pytest.mark.slow
def test_fsdp_checkpoint_keeps_accelerates_layout_with_one_shard_per_rank(runs):
    _, out = runs.get("pretrain", "fsdp")
    summary = check_fsdp_checkpoint(checkpoint(out), world=2)
    assert summary["files"] == ["__0_0.distcp", "__1_0.distcp"] and summary["sharded_tensors"] > 20
    assert (checkpoint(out) / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert not (checkpoint(out) / "model.safetensors").exists()  # the model is only in the shards


@pytest.mark.slow
def test_fsdp_checks_reject_the_ddp_fallback(runs):
    """The same recipe under DDP (what accelerate silently runs for an FSDP config on CPU) fails every FSDP check."""
    ddp, ddp_out = runs.get("pretrain", "ddp")
    assert results(ddp_out)["distributed_type"] == "MULTI_CPU"
    with pytest.raises(
        NotWhatWasAsked, match=r"gpt_neox.embed_in.weight is a plain Parameter of shape \[384, 64\], not a DTensor"
    ):
        check_fsdp(ddp, world=2)
    with pytest.raises(NotWhatWasAsked, match="has no pytorch_model_fsdp_0/"):
        check_fsdp_checkpoint(checkpoint(ddp_out), world=2)
    zero3, _ = runs.get("pretrain", "zero3")
    with pytest.raises(NotWhatWasAsked, match="not a DTensor"):
        check_fsdp(zero3, world=2)


@pytest.mark.slow
def test_fsdp_checks_reject_replicated_or_whole_shards_and_missing_rank_files(runs, tmp_path):
    observations, out = runs.get("pretrain", "fsdp")
    replicated = copy.deepcopy(observations)
    for obs in replicated:
        for p in obs["step_end"]["params"].values():
            p["dtensor"].update(placements=["R"], local_shape=p["shape"])
    with pytest.raises(NotWhatWasAsked, match=r"placed \['R'\] on a mesh of 2, not Shard\(0\) over 2"):
        check_fsdp(replicated, world=2)
    whole = copy.deepcopy(observations)  # claims Shard(0) but each rank holds the whole tensor
    for obs in whole:
        for p in obs["step_end"]["params"].values():
            p["dtensor"]["local_shape"] = p["shape"]
    with pytest.raises(
        NotWhatWasAsked,
        match=r"rank 0: gpt_neox.embed_in.weight of shape \[384, 64\] holds \[384, 64\], expected \[192, 64\]",
    ):
        check_fsdp(whole, world=2)
    with pytest.raises(NotWhatWasAsked, match="expected observations from 4 rank"):
        check_fsdp(observations, world=4)
    one_file = tmp_path / "ckpt"
    shutil.copytree(checkpoint(out), one_file)
    (one_file / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()
    with pytest.raises(NotWhatWasAsked, match=r"holds \['__0_0.distcp'\], expected one __R_0.distcp per rank of 2"):
        check_fsdp_checkpoint(one_file, world=2)


def test_shard_rows_follow_torch_chunk():
    import torch

    for rows in (1, 2, 3, 7, 384, 385):
        for world in (1, 2, 3, 8):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)]  # torch.chunk may return fewer chunks
            assert [shard_rows(rows, world, r) for r in range(world)] == chunks + [0] * (world - len(chunks))


# ------------------------------------------------------------------------------------------------ ZeRO-3
@pytest.mark.slow
def test_zero3_parameters_are_partitioned_with_exact_local_sizes(runs):
    observations, out = runs.get("pretrain", "zero3")
    assert (results(out)["distributed_type"], results(out)["world_size"]) == ("DEEPSPEED", 2)
    for when in ("train_begin", "step_end"):
        summary = check_zero3(observations, world=2, when=when)
        assert summary["local_numel"][0] == summary["local_numel"][1] >= summary["full_numel"] / 2
    embed = observations[0]["step_end"]["params"]["gpt_neox.embed_in.weight"]
    # placeholder; half held
    assert embed["numel"] == 0 and embed["zero3"]["local_numel"] == embed["zero3"]["ds_numel"] // 2


@pytest.mark.slow
def test_zero3_checkpoint_holds_each_ranks_partition(runs):
    _, out = runs.get("pretrain", "zero3")
    summary = check_zero3_checkpoint(checkpoint(out), world=2)
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= set(summary["files"])
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(summary["files"])
    assert summary["partition_numel"][0] < 0.51 * summary["full_numel"]


@pytest.mark.slow
def test_zero3_checks_reject_the_ddp_fallback_and_unpartitioned_parameters(runs):
    ddp, ddp_out = runs.get("pretrain", "ddp")
    with pytest.raises(
        NotWhatWasAsked, match=r"gpt_neox.embed_in.weight has no ds_numel/ds_tensor: not partitioned by ZeRO-3"
    ):
        check_zero3(ddp, world=2)
    with pytest.raises(NotWhatWasAsked, match="instead of one global_stepN/"):
        check_zero3_checkpoint(checkpoint(ddp_out), world=2)
    fsdp, fsdp_out = runs.get("pretrain", "fsdp")
    with pytest.raises(NotWhatWasAsked, match="not partitioned by ZeRO-3"):
        check_zero3(fsdp, world=2)
    with pytest.raises(NotWhatWasAsked, match="instead of one global_stepN/"):
        check_zero3_checkpoint(checkpoint(fsdp_out), world=2)
    observations, _ = runs.get("pretrain", "zero3")
    whole = copy.deepcopy(observations)  # ZeRO-1/2-like: every rank holds every weight
    for obs in whole:
        for p in obs["step_end"]["params"].values():
            p["zero3"]["local_numel"] = p["zero3"]["ds_numel"]
    with pytest.raises(NotWhatWasAsked, match=r"rank 0: gpt_neox.embed_in.weight holds 24576 of 24576, expected 12288"):
        check_zero3(whole, world=2)
    gathered = copy.deepcopy(observations)
    for obs in gathered:
        for p in obs["step_end"]["params"].values():
            p["numel"], p["shape"] = p["zero3"]["ds_numel"], p["zero3"]["ds_shape"]
    with pytest.raises(
        NotWhatWasAsked, match=r"gpt_neox.embed_in.weight is gathered \(\[384, 64\]\) outside a forward pass"
    ):
        check_zero3(gathered, world=2)


# ------------------------------------------------------------------------------------------------ quantized
QUANTIZED_RUNS = [
    ("qlora", "single"),
    ("qlora", "ddp"),
    ("qlora", "fsdp"),
    ("lora_8bit", "single"),
    ("lora_8bit", "ddp"),
]


@pytest.mark.parametrize(
    "method, backend",
    [pytest.param(m, b, marks=[pytest.mark.slow] if b != "single" else []) for m, b in QUANTIZED_RUNS],
)
def test_quantized_methods_hold_bitsandbytes_layers(runs, method, backend):
    """The README's fine-tuning matrix: qlora on one process, DDP and FSDP; lora_8bit on one process and DDP."""
    observations, out = runs.get(method, backend)
    world = 1 if backend == "single" else 2
    assert len(observations) == world and results(out)["world_size"] == world
    for obs in observations:
        summary = check_quantized(obs, method, strategy=backend, world=world)
        assert summary["layers"] == 8  # 2 layers x 4 projections; the output head stays unquantized
        # 4 / 8 bits of 16
        assert summary["ratio_to_bf16"] == pytest.approx(0.25 if method == "qlora" else 0.5, abs=0.01)
    if backend == "fsdp":
        check_fsdp(observations, world=2)  # the packed 4-bit weights are sharded like every other parameter


def test_quantized_checks_reject_an_unquantized_model_and_the_other_method(runs):
    lora, _ = runs.get("lora", "single")
    with pytest.raises(NotWhatWasAsked, match=r"no bitsandbytes layer in the model: it was loaded unquantized"):
        check_quantized(lora[0], "qlora")
    qlora, _ = runs.get("qlora", "single")
    with pytest.raises(NotWhatWasAsked, match="is Linear4bit, not Linear8bitLt"):
        check_quantized(qlora[0], "lora_8bit")
    doctored = copy.deepcopy(qlora[0])
    for layer in doctored["step_end"]["quantized"].values():
        layer["quant_state"] = None
    with pytest.raises(NotWhatWasAsked, match="4-bit weight without a quant_state"):
        check_quantized(doctored, "qlora")
    eight, _ = runs.get("lora_8bit", "single")
    doctored = copy.deepcopy(eight[0])
    for layer in doctored["step_end"]["quantized"].values():
        layer["int8_scales"] = False
    with pytest.raises(NotWhatWasAsked, match=r"int8 weight without its scales \(SCB\)"):
        check_quantized(doctored, "lora_8bit")


@pytest.mark.slow
def test_fsdp_qlora_check_rejects_unsharded_uint8_weights(runs):
    """Under DDP the 4-bit weights are whole uint8 copies on each rank: what FSDP would leave unsharded."""
    ddp, _ = runs.get("qlora", "ddp")
    with pytest.raises(NotWhatWasAsked, match="weight stored as uint8, expected bfloat16"):
        check_quantized(ddp[0], "qlora", strategy="fsdp", world=2)
    relabelled = copy.deepcopy(ddp[0])  # right dtype, still whole on each rank
    for layer in relabelled["step_end"]["quantized"].values():
        layer["weight_dtype"] = "bfloat16"
    with pytest.raises(NotWhatWasAsked, match="quantized weight not sharded over 2 ranks"):
        check_quantized(relabelled, "qlora", strategy="fsdp", world=2)


# --------------------------------------------------------------------------- accelerate's state during training
@pytest.mark.slow
def test_cpu_fsdp_rehearsal_keeps_accelerates_distributed_type_during_training(runs):
    observations, _ = runs.get("pretrain", "fsdp")
    assert [o["distributed_type_at_train_begin"] for o in observations] == ["FSDP", "FSDP"]
