"""Start-up in the order parse, validate, decide, then measure: a refusal comes before any work is printed or done,
and a measurement that would cost more than it can save is skipped and says so. In this process, through the CLI's
own entry point."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from hftrain.errors import HftrainError

from ..support.cli import in_process
from .conftest import fill

# (name, argv with conftest.fill's placeholders, the message, a line of the work that must not come before it)
FIRST = [
    (
        "plan: an unknown card",
        ["plan", "{recipe}", "--gpus", "2", "--gpu-type", "H10O"],
        "--gpu-type 'H10O': no data-sheet peak known; give one of ",
        "parameters",
    ),
    (
        "plan: a card without --gpus",
        ["plan", "{recipe}", "--gpu-type", "H100"],
        "--gpu-type 'H100' names the card of --gpus N",
        "parameters",
    ),
    (
        "check-packing: a missing data file",
        ["data", "inspect", "{recipe}", "--check-packing", "data.train.path={tmp}/gone.jsonl"],
        "data.train[0].path: no file matches '{tmp}/gone.jsonl'",
        "check-packing:",
    ),
    (
        "train: lr_schedule beside a DeepSpeed scheduler block",  # before: DeepSpeed's schedule ran, without a word
        ["train", "{annealing}", "training.deepspeed={ds_scheduler}"],
        'lr_schedule.type gpt_neox_annealing: the DeepSpeed config {ds_scheduler} has a "scheduler" block '
        "(WarmupDecayLR), which DeepSpeed runs in place of the recipe's schedule. Remove the block",
        "speed defaults:",
    ),
]


@pytest.mark.parametrize("name, argv, expected, work_line", FIRST, ids=[c[0] for c in FIRST])
def test_a_refusal_comes_before_any_work(capsys, work, name, argv, expected, work_line):
    places = fill(work)
    code, printed = in_process(capsys, *(word.format(**places) for word in argv))
    assert code == 2 and "Traceback" not in printed, (code, printed[-2000:])
    assert expected.format(**places) in printed, printed[-2000:]
    assert work_line not in printed, printed[-2000:]  # before: the whole plan, or "check-packing: ... off" and exit 0


def test_the_fit_of_a_large_model_is_said_at_once_and_its_probe_skipped(capsys, monkeypatch, recipe_file):
    """pythia-1b at 64 x 2,048 with parallelism.fit_memory on a CPU: the fit's verdict (a micro-batch that fits, or
    that none does on a smaller machine: parallelism.memory_check: warn goes on, where it would be refused) is said
    before the speed levers are decided, and the speed probe (minutes at this shape: before, killed at 120 s with
    nothing said) is skipped, saying why. The
    run is stopped once its speed levers are decided (the test has no use for a 1B-parameter CPU step)."""
    from hftrain.speed import probe
    from hftrain.training import run as training_run

    # The probe's cost is estimated from this machine's matmul speed: given here (this AMX Xeon's 256^3 fp32
    # matmul, 300 GFLOP/s), so that the test states the rule and not how fast the machine running it is.
    monkeypatch.setattr(probe, "_small_matmul_seconds", lambda device, dtype: 2 * 256**3 / 300e9)
    decided = {}

    def stop_after_deciding(*args, **kwargs):
        decided["said before"] = capsys.readouterr().out  # what the run printed before deciding its speed levers
        decided["values"], decided["speed"] = _, speed = real(*args, **kwargs)
        raise HftrainError(f"stopped by the test; speed defaults: {'; '.join(speed.reasons)}")

    real = training_run.set_up  # the set-up step that decides the speed levers (the probe)
    monkeypatch.setattr(training_run, "set_up", stop_after_deciding)
    raw = yaml.safe_load(recipe_file.read_text())
    for lever in ("bf16", "torch_compile"):  # the test recipes pin them; here the probe would decide them
        raw["training"].pop(lever)
    unpinned = recipe_file.with_name("unpinned.yaml")
    unpinned.write_text(yaml.safe_dump(raw), encoding="utf-8")
    code, printed = in_process(
        capsys,
        "train",
        str(unpinned),
        "model.preset=pythia-1b",
        "tokenizer.train=null",
        "tokenizer.builtin=gpt2",
        "data.seq_len=2048",
        "training.per_device_train_batch_size=64",
        "parallelism.fit_memory=true",
        "parallelism.memory_check=warn",
    )
    assert code == 2 and "stopped by the test" in printed, printed[-3000:]
    assert re.search(
        r"^hftrain: (warning: parallelism.fit_memory: |memory fit \(parallelism.fit_memory\): )",
        decided["said before"],
        re.M,
    ), decided["said before"][-3000:]
    assert "measuring this CPU's step speed" not in decided["said before"] + printed, printed[-3000:]
    reasons = "; ".join(decided["speed"].reasons)
    assert "the speed probe would take about" in reasons and "set them in the recipe to choose" in reasons, reasons


# A 256^3 fp32 matmul's speed, as measured on two 2-core machines (GFLOP/s): the probe's estimate scales with it.
MATMUL_GFLOPS = {"AMX Xeon": 300.0, "AVX2-only EPYC": 57.0}


@pytest.mark.parametrize("machine", MATMUL_GFLOPS)
def test_the_probe_budget_keeps_the_shapes_it_pays_for(monkeypatch, machine):
    """The estimate that skips pythia-1b's probe leaves the quickstart's probe, and pythia-160m's where the machine
    runs it within the budget (13 s on the Xeon; the EPYC's 68 s is over it: skipped there, saying so). The speed
    is given, never read off the machine running the test (it estimated 68 s on an EPYC, 13 s here)."""
    import torch

    from hftrain.speed import probe
    from hftrain.speed.probe import PROBE_BUDGET_S, ProbeShape, expected_seconds

    monkeypatch.setattr(
        probe, "_small_matmul_seconds", lambda device, dtype: 2 * 256**3 / (MATMUL_GFLOPS[machine] * 1e9)
    )
    cpu = torch.device("cpu")

    def shape(tokens, seq, hidden, layers, vocab):
        return ProbeShape(
            tokens=tokens,
            seq=seq,
            hidden=hidden,
            intermediate=4 * hidden,
            heads=8,
            vocab=vocab,
            layers=layers,
            parameters=0,
            options=(),
        )

    assert expected_seconds(shape(16 * 128, 128, 128, 4, 4096), cpu) < PROBE_BUDGET_S / 20  # the quickstart
    pythia_160m = expected_seconds(shape(8 * 512, 512, 768, 12, 50304), cpu)  # at 8 x 512
    assert (pythia_160m < PROBE_BUDGET_S) is (machine == "AMX Xeon"), pythia_160m
    assert expected_seconds(shape(64 * 2048, 2048, 2048, 16, 50304), cpu) > PROBE_BUDGET_S  # pythia-1b at 64 x 2,048


@pytest.mark.parametrize(
    "launch, refused",
    [
        ("the accelerate YAML's file", True),
        ("an inline JSON", True),
        ("the shipped zero3.json, by its relative name", False),
        ("no lr_schedule.type", False),
        ("a file that is not JSON", True),
    ],
)
def test_a_deepspeed_scheduler_block_beside_lr_schedule_is_refused_however_it_is_given(
    launch, refused, tmp_path, monkeypatch
):
    """accelerate launch passes the YAML's deepspeed_config_file on in ACCELERATE_DEEPSPEED_CONFIG_FILE: its
    "scheduler" block replaces the recipe's schedule there too."""
    from hftrain.parallel.dims import DEEPSPEED_FILE_ENV, check_deepspeed_schedule

    scheduled = {"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}}
    (tmp_path / "ds.json").write_text(json.dumps(scheduled), encoding="utf-8")
    given = {
        "the accelerate YAML's file": str(tmp_path / "ds.json"),
        "an inline JSON": '{"scheduler": {"type": "WarmupLR"}}',
        "the shipped zero3.json, by its relative name": "deepspeed/zero3.json",
        "no lr_schedule.type": str(tmp_path / "ds.json"),
        "a file that is not JSON": str(tmp_path / "broken.json"),
    }[launch]
    (tmp_path / "broken.json").write_text('{"zero_optimization": {"stage": 3},}', encoding="utf-8")
    monkeypatch.setenv(DEEPSPEED_FILE_ENV, given)
    kind = None if launch == "no lr_schedule.type" else "gpt_neox_annealing"
    if not refused:
        check_deepspeed_schedule(None, kind)
        return
    expected = (
        rf"^the DeepSpeed config {tmp_path}/broken.json: not JSON \(line 1, column 36: "
        if launch == "a file that is not JSON"
        else r'has a "scheduler" block \(WarmupLR\), which DeepSpeed runs in place'
    )
    with pytest.raises(HftrainError, match=expected):
        check_deepspeed_schedule(None, kind)
