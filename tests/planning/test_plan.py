"""`hftrain plan` before renting GPUs: the peak per process by component, a layout that fits with its reason, time
and cost; `parallelism.fit_memory` and the warning in `train`; the prediction against measured peaks of real runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hftrain
from hftrain.cli import main
from hftrain.planning import fit as fitting
from hftrain.planning.estimates import plan
from hftrain.planning.memory import GB, predict_peak, run_shape
from hftrain.planning.part import PlanPart
from hftrain.recipe.load import load_recipe

from ..support.data import make_documents, tiny_recipe, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
PYTHIA_1B = str(ROOT / "recipes/pretrain/pythia-1b.yaml")


def plan_output(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_pythia_1b_on_8_gpus_counts_activations_and_logits_and_fits_with_a_margin(capsys):
    out = plan_output(capsys, PYTHIA_1B, "--gpus", "8", "--gpu-mem-gb", "80", "--price-per-hour", "2")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and " GB" in line}
    gb = lambda name: float(re.search(r"([\d.,]+) GB", lines[name]).group(1))  # noqa: E731
    # micro-batch 8 x 2,048 tokens in bf16: tens of GB of activations, GBs of logits, on top of 16.2 GB of state
    assert gb("activations") > 15 and gb("logits") > 5 and gb("weights") == 4.05 and gb("optimizer") == 8.09
    peak = float(out.split("predicted peak: ")[1].split()[0])
    # backward frees the activations as it fills the gradients: the step holds the larger of the two
    assert peak == pytest.approx(
        sum(gb(k) for k in ("weights", "optimizer", "activations", "logits", "autocast")), abs=0.02
    )
    # bf16 copies of the 909M matmul weights (head included)
    assert gb("autocast") == pytest.approx(2 * 0.909, abs=0.01)
    rec = out.split("recommendation: ")[1].splitlines()[0]
    assert (
        rec.startswith("ddp, micro-batch 8 x accumulation 16, gradient checkpointing off") and "within 72.0 GB" in rec
    )
    assert "micro-batch 16 would need" in rec  # says why not more
    assert f"predicted peak {peak:.2f} GB" in rec and peak < 72.0
    hours = float(out.split("run: 143,000 steps = ")[1].split()[0].replace(",", ""))
    assert "MFU 0.35, assumed" in out and "PaLM" in out and "H100 SXM" in out
    cost = float(out.split("cost: ")[1].split("= $")[1].split()[0].replace(",", ""))
    assert cost == pytest.approx(hours * 8 * 2, rel=1e-3)


def test_a_layout_that_fits_keeps_the_global_batch():
    recipe = load_recipe(PYTHIA_1B, [])
    info = plan(PlanPart.of(recipe))
    roomy, tight, tiny = fitting.gpus(8, 80), fitting.gpus(8, 40), fitting.gpus(8, 2)
    assert fitting.choose(PlanPart.of(recipe), info, roomy).shape.strategy == "ddp"
    squeezed = fitting.choose(PlanPart.of(recipe), info, tight)
    s = squeezed.shape
    assert squeezed.fits and (s.micro_batch < 8 or s.strategy != "ddp")
    assert s.micro_batch * squeezed.accumulation * 8 == 1024  # the recipe's global batch, accumulation derived
    assert "no faster layout fits" in squeezed.reason or "would need" in squeezed.reason
    nothing = fitting.choose(PlanPart.of(recipe), info, tiny)
    assert not nothing.fits and nothing.reason.startswith("nothing fits: the smallest layout")
    # the check can fail: the recipe's own layout does not fit 40 GB
    assert not fitting.as_configured(PlanPart.of(recipe), info, tight).fits


def test_sharding_and_checkpointing_lower_the_predicted_peak():
    recipe = load_recipe(PYTHIA_1B, [])
    info = plan(PlanPart.of(recipe))

    def peak(**kw):
        return predict_peak(PlanPart.of(recipe), info, run_shape(PlanPart.of(recipe), "cuda", 8, **kw)).total

    ddp, fsdp, gc = peak(strategy="ddp"), peak(strategy="fsdp"), peak(strategy="ddp", checkpointing=True)
    assert fsdp < ddp - 8 * GB  # weights and AdamW over 8 GPUs (embeddings, head and one layer gathered)
    assert gc < ddp - 15 * GB  # one layer's activations instead of 16
    lora = predict_peak(
        PlanPart.of(load_recipe(PYTHIA_1B, ["finetune.method=lora"])),
        info | plan(PlanPart.of(load_recipe(PYTHIA_1B, ["finetune.method=lora"]))),
        run_shape(PlanPart.of(recipe), "cuda", 8, strategy="ddp"),
    ).total
    assert lora < ddp - 7 * GB  # no AdamW state (8 GB) for the frozen base


def test_dpo_counts_its_reference_copy_and_both_answers():
    """Full DPO holds a frozen reference as large as the weights (sharded as they are); both answers of a pair
    run through the model, so the activations double; TRL's fused head never holds a micro-batch's logits."""
    dpo = ["finetune.objective=dpo", "data.train.format=preference"]
    lm, full = load_recipe(PYTHIA_1B, []), load_recipe(PYTHIA_1B, dpo)
    info = plan(PlanPart.of(lm))
    for strategy, processes in (("ddp", 8), ("fsdp", 8), ("single", 1)):
        a, b = (
            predict_peak(PlanPart.of(r), info, run_shape(PlanPart.of(r), "cuda", processes, strategy=strategy))
            for r in (lm, full)
        )
        assert b.parts["reference weights"] == a.parts["weights"] > 0, strategy
        assert b.parts["activations"] == pytest.approx(2 * a.parts["activations"]), strategy
        assert b.parts["logits and loss"] < a.parts["logits and loss"] / 4, strategy
    fsdp = predict_peak(PlanPart.of(full), info, run_shape(PlanPart.of(full), "cuda", 8, strategy="fsdp")).parts[
        "reference weights"
    ]
    assert (
        fsdp
        < predict_peak(PlanPart.of(full), info, run_shape(PlanPart.of(full), "cuda", 8, strategy="ddp")).parts[
            "reference weights"
        ]
        / 2
    )
    lora = load_recipe(PYTHIA_1B, [*dpo, "finetune.method=lora"])
    # the adapter disabled
    assert (
        "reference weights"
        not in predict_peak(
            PlanPart.of(lora), info | plan(PlanPart.of(lora)), run_shape(PlanPart.of(lora), "cuda", 8)
        ).parts
    )
    # + the reference's forward
    assert plan(PlanPart.of(full))["train_flops_per_token"] == pytest.approx(4 / 3 * info["train_flops_per_token"])
    assert plan(PlanPart.of(full))["tokens_per_step_per_device"] == 2 * info["tokens_per_step_per_device"]


def test_plan_refuses_numbers_that_cannot_work(capsys):
    for argv, message in (
        (["--gpus", "0"], "argument --gpus: 0 cannot work: give a whole number of 1 or more"),
        (["--mfu", "1.5"], "argument --mfu: 1.5 cannot work: give a number above 0 and at most 1"),
        (["--price-per-hour", "0"], "argument --price-per-hour: 0 cannot work: give a number above 0"),
        (["--gpus", "2", "--gpu-type", "Z9"], "--gpu-type 'Z9': no data-sheet peak known"),
    ):
        try:
            code = main(["plan", PYTHIA_1B, *argv])
        except SystemExit as refused:  # argparse's own refusal (cli/numbers.py)
            code = refused.code
        assert code == 2
        assert message in capsys.readouterr().err


def test_plan_imports_nothing_it_does_not_need():
    """`plan` prints numbers computed on paper: the Trainer, transformers' modeling stack (the model is counted from
    its config, model/shape.py), datasets, DeepSpeed and plotting stay unimported (torch itself may load
    torch._dynamo)."""
    from hftrain.recipe import transformers_table

    transformers_table.table.cache_clear()
    # kept in hftrain's cache as a machine's first command keeps it (one import of TrainingArguments)
    transformers_table.table()
    heavy = ("datasets", "transformers.trainer", "transformers.modeling_utils", "deepspeed", "matplotlib")
    code = (
        "import sys; from hftrain.cli import main; main(['plan', sys.argv[1], '--gpus', '8']); "
        f"print('LOADED', sorted(m for m in {heavy} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, PYTHIA_1B], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED []" in done.stdout


@pytest.fixture
def small_machine(monkeypatch):
    """This machine with 1.2 GB of RAM: the tiny recipe's micro-batch 64 does not fit, 8 does."""
    monkeypatch.setattr(
        fitting,
        "this_machine",
        lambda processes=1: fitting.Machine("cpu", processes, 1.2 * GB / processes, "a 1.2 GB test machine"),
    )
    monkeypatch.setattr(fitting, "library_footprint", lambda: 0.6 * GB)


def fit_recipe(tmp_path: Path, **extra) -> hftrain.Recipe:
    data = write_jsonl(tmp_path / "d.jsonl", make_documents(400))
    raw = tiny_recipe(
        data,
        tmp_path / "run",
        max_steps=1,  # a step of 64 x 128 tokens of gpt2 logits is costly; the warning and the fit come before it
        save_steps=100,
        per_device_train_batch_size=64,
        per_device_eval_batch_size=64,
        gradient_accumulation_steps=1,
    )
    raw["model"] = {"preset": "pythia-14m"}
    raw["tokenizer"] = {"builtin": "gpt2"}
    raw["data"].update(seq_len=128, eval_blocks=64)
    raw["monitor"]["sample_max_new_tokens"] = 0
    for key, value in extra.items():
        raw.setdefault(key.split(".")[0], {})[key.split(".")[1]] = value
    return load_recipe(None, raw)


@pytest.mark.slow(seconds=75)  # the suite's order: the longest files start first (tests/conftest.py)
def test_train_warns_before_step_1_and_fit_memory_takes_the_fitting_micro_batch(small_machine, tmp_path, capsys):
    """One tiny run each way: the explicit micro-batch is warned about (with the numbers; it is far over the memory,
    so only parallelism.memory_check: warn trains it: test_certain_oom.py has the refusal); fit_memory trains with
    plan's micro-batch and checkpointing at the same global batch."""
    as_given = fit_recipe(tmp_path / "a", **{"parallelism.memory_check": "warn"})
    info = plan(PlanPart.of(as_given))
    machine = fitting.this_machine()
    assert not fitting.as_configured(
        PlanPart.of(as_given), info, machine, libraries=0.6 * GB
    ).fits  # 64 x 128 tokens of logits
    chosen = fitting.choose(PlanPart.of(as_given), info, machine, libraries=0.6 * GB)
    assert chosen.fits and chosen.shape.micro_batch < 64

    hftrain.train(as_given)
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "warning: training.per_device_train_batch_size=64" in line)
    assert "more than the 1.1 GB usable on a 1.2 GB test machine" in warning
    assert (
        f"parallelism.fit_memory: true would take single, micro-batch {chosen.shape.micro_batch} x accumulation "
        f"{chosen.accumulation}" in warning
    )
    assert f"evaluation batch {chosen.shape.eval_batch}" in warning
    assert out.index(warning) < out.index("'loss'")  # before step 1

    fitted = hftrain.train(fit_recipe(tmp_path / "b", **{"parallelism.fit_memory": True}))
    out = capsys.readouterr().out
    assert (
        f"hftrain: memory fit (parallelism.fit_memory): single, micro-batch {chosen.shape.micro_batch} x accumulation "
        f"{chosen.accumulation}" in out
    )
    args = fitted.trainer.args
    assert args.per_device_train_batch_size == chosen.shape.micro_batch
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 64  # the global batch is kept
    assert args.per_device_eval_batch_size == chosen.shape.eval_batch
    assert "warning" not in out


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """One scratch folder, speed cache and libraries' figures (measured and as plan predicts them) for both rows."""
    from benchmarks.plan_calibration import library_peak, predicted_libraries

    work = tmp_path_factory.mktemp("calibration")
    env = {**os.environ, "HFTRAIN_CACHE_DIR": str(work / "cache")}
    return work, env, library_peak(env), predicted_libraries(env)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["31m-b4-s256", "31m-lora-b8-s256"])
def test_predicted_peak_is_within_15_percent_of_a_real_run(name, calibration):
    """Two rows of benchmarks/plan_calibration.py: a pretraining run that peaks in its final evaluation and a LoRA
    run that peaks in a training step, each a real 3-step `hftrain train` watched from outside (VmHWM). The
    libraries' part is measured the same way, so the model part above it is checked on its own too."""
    from benchmarks.plan_calibration import GRID, build_bases, measure

    work, env, libraries, predicted_libraries = calibration
    config = next(c for c in GRID if c.name == name)
    if config.method != "pretrain":
        build_bases(work / "bases", {config.size})
    row = measure(config, work / "bases", work, env, predicted_libraries)
    print(
        f"{name}: measured {row['measured'] / GB:.3f} GB, predicted {row['predicted'] / GB:.3f} GB ({row['phase']}), "
        f"libraries {libraries / GB:.3f} GB measured, {predicted_libraries / GB:.3f} GB predicted"
    )
    assert row["predicted"] == pytest.approx(row["measured"], rel=0.15)
    assert row["predicted"] - predicted_libraries == pytest.approx(row["measured"] - libraries, rel=0.15)
    # the check can fail: the training state alone (what `plan` printed before) is far below the measured peak
    state = sum(row["parts"].get(k, 0) for k in ("libraries", "weights", "gradients", "optimizer"))
    assert state < 0.85 * row["measured"]


def test_the_launcher_warns_once_before_starting_processes(capsys, monkeypatch):
    """`hftrain train --accelerate-config` says it before any process starts, and tells the processes it did: in
    their environment, never this process's own (a launcher in a notebook or a test kept every later run of that
    process from warning)."""
    from hftrain.launch import processes as launch
    from hftrain.parallel import rehearsal
    from hftrain.parallel.child_errors import MEMORY_WARNED_ENV
    from hftrain.parallel.dims import Strategy

    monkeypatch.delenv(MEMORY_WARNED_ENV, raising=False)
    monkeypatch.setattr(fitting, "library_footprint", lambda: 0.6 * GB)
    started: dict[str, str] = {}
    monkeypatch.setattr(rehearsal, "launch_processes", lambda *args, env=None: started.update(env or {}) or 0)
    # far over any machine's memory: refused unless parallelism.memory_check: warn (test_certain_oom.py)
    huge = load_recipe(
        str(ROOT / "recipes/quickstart.yaml"),
        ["training.per_device_train_batch_size=65536", "parallelism.memory_check=warn"],
    )
    assert launch.relaunch(["r.yaml"], "ddp", 2, True, PlanPart.of(huge)) == 0
    out = capsys.readouterr().out
    assert "hftrain: warning: training.per_device_train_batch_size=65536" in out and "GB per process" in out
    assert started[MEMORY_WARNED_ENV] == "1" and MEMORY_WARNED_ENV not in os.environ
    launch._warn_memory(PlanPart.of(load_recipe(str(ROOT / "recipes/quickstart.yaml"), [])), Strategy.DDP, 2, cpu=True)
    assert "warning" not in capsys.readouterr().out  # the check can fail: the shipped micro-batch fits


def test_this_machines_matmul_peak_is_measured_once_and_kept(tmp_path, monkeypatch):
    """`hftrain plan` on this machine times a step with its measured matmul peak: measured the first time (half a
    second), then read from hftrain's cache for the same processor, threads, torch and dtype."""
    import torch

    from hftrain.speed import hardware

    monkeypatch.setenv("HFTRAIN_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    flops, how = hardware.peak_flops_here(cpu, torch.float32)
    assert flops > 0 and how == "measured here now"
    measured = []
    monkeypatch.setattr(hardware, "measure_peak_flops", lambda device, dtype: measured.append(dtype) or 1.0)
    kept, how = hardware.peak_flops_here(cpu, torch.float32)
    assert kept == flops and how.startswith("measured on this machine on 20") and measured == []
    assert hardware.peak_flops_here(cpu, torch.bfloat16) == (1.0, "measured here now") and measured == [torch.bfloat16]
