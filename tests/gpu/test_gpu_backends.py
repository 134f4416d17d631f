"""GPU tier, item 3: FSDP and ZeRO-3 at world size 1, and 2 when the machine has 2 GPUs or more, verified on the
model itself (DTensor shards, ZeRO-3 partitions, per-rank checkpoint files: tests/support/backend_checks.py); exact
resume from a mid-run checkpoint; export to one model plain transformers loads; device_map."""

from __future__ import annotations

import sys

import pytest

from ..support.backend_checks import check_fsdp, check_fsdp_checkpoint, check_zero3, check_zero3_checkpoint
from ..support.backend_probe import load_observations, run_probe
from ..support.checks import copy_checkpoint
from ..support.data import make_documents, tiny_recipe, write_jsonl
from . import support

pytestmark = pytest.mark.gpu
ITEM = "backends"
EXPECTED = {
    "fsdp": ("FSDP", check_fsdp, check_fsdp_checkpoint),
    "zero3": ("DEEPSPEED", check_zero3, check_zero3_checkpoint),
}
CONFIG = {"fsdp": "fsdp", "zero3": "deepspeed_zero3"}


def small_recipe(tmp_path, out) -> dict:
    data = write_jsonl(tmp_path / "train.jsonl", make_documents(2000))
    raw = tiny_recipe(data, out, max_steps=6, save_steps=3, logging_steps=1)
    raw["model"] = {"preset": "cpu-small"}  # fp32 (exact resume), hidden 128: big enough for several rows per rank
    raw["monitor"].update(sample_max_new_tokens=0, peak_tflops=None)
    return raw


def gpus_or_skip(world: int) -> None:
    if support.gpu_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {support.gpu_count()}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_sharded_backend_trains_resumes_exactly_and_exports(tmp_path, backend, world):
    gpus_or_skip(world)
    kind, check_model, check_checkpoint = EXPECTED[backend]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    recipe_file = support.write_recipe(small_recipe(tmp_path, straight), tmp_path / "recipe.yaml")
    support.accelerate(
        CONFIG[backend],
        world,
        str(support.ROOT / "tests" / "support" / "backend_probe.py"),
        str(recipe_file),
        str(tmp_path / "probe"),
    )
    r = support.results(straight)
    assert (r["distributed_type"], r["world_size"]) == (kind, world)
    model_summary = check_model(load_observations(tmp_path / "probe"), world)
    checkpoint_summary = check_checkpoint(straight / "checkpoint-6", world)

    copy_checkpoint(straight, resumed, "checkpoint-3")  # resume from step 3, as a killed run would have left it
    support.accelerate(
        CONFIG[backend], world, "-m", "hftrain", "train", str(recipe_file), f"training.output_dir={resumed}"
    )
    a, b = support.logged(straight), support.logged(resumed)
    resume_diff = max(abs(a[s] - b[s]) / abs(a[s]) for s in (4, 5, 6))
    assert resume_diff < 1e-4, (a, b)

    exported = tmp_path / "exported"
    support.hftrain("export", str(straight / "checkpoint-6"), "--out", str(exported))
    script = (
        "import sys, torch\nfrom transformers import AutoModelForCausalLM\nids = torch.arange(1, 20).unsqueeze(0)\n"
        f"a = AutoModelForCausalLM.from_pretrained({str(exported)!r}).eval()(ids).logits\n"
        f"b = AutoModelForCausalLM.from_pretrained({str(straight / 'final')!r}).eval()(ids).logits\n"
        "assert 'hftrain' not in sys.modules\nprint(float((a - b).abs().max()))\n"
    )
    export_diff = float(support.run([sys.executable, "-c", script]).stdout.strip().splitlines()[-1])
    assert export_diff < 1e-4
    support.record(
        ITEM,
        f"{backend}_world{world}",
        {
            "distributed_type": kind,
            "world_size": world,
            "local_numel_per_rank": model_summary["local_numel"],
            "full_numel": model_summary["full_numel"],
            "checkpoint_files": checkpoint_summary["files"],
            "resume_max_rel_loss_diff": resume_diff,
            "export_max_logit_diff": export_diff,
            "eval_loss": r["eval_loss"],
        },
    )


def test_device_map_spreads_the_model_over_the_visible_gpus(tmp_path):
    out = tmp_path / "device_map"
    raw = small_recipe(tmp_path, out)
    raw["parallelism"] = {"strategy": "device_map"}
    if support.gpu_count() >= 2:  # a ~3.5 MB model: budgets of 3 MiB per GPU make it spread over two or more
        raw["parallelism"]["max_memory"] = {i: "3MiB" for i in range(support.gpu_count())}
    raw["training"].update(max_steps=4, save_steps=4)
    observations = run_probe(support.write_recipe(raw, tmp_path / "dm.yaml"), tmp_path / "probe", backend=None)
    r = support.results(out)
    assert (r["distributed_type"], r["world_size"]) == ("NO", 1)
    devices = sorted({p["device"] for p in observations[0]["step_end"]["params"].values()})
    assert all(d.startswith("cuda") for d in devices), devices
    if support.gpu_count() >= 2:
        assert len(devices) >= 2, devices  # the layers really spread
    losses = support.logged(out)
    assert losses[max(losses)] < losses[min(losses)]
    support.record(ITEM, "device_map", {"gpus": support.gpu_count(), "devices": devices, "eval_loss": r["eval_loss"]})
