"""GPU tier, item 1: bf16 + torch.compile pretraining of the quickstart, and the pythia-160m preset at 2048 tokens:
tokens/s, MFU against the GPU's spec-sheet bf16 peak and against a measured matmul peak, peak memory."""

from __future__ import annotations

import pytest

from benchmarks.gpu_peaks import gpu_peaks, mfu

from . import support

pytestmark = pytest.mark.gpu
ITEM = "training"


@pytest.fixture(scope="module")
def peaks() -> dict:
    return gpu_peaks(seconds=1.0)  # measured before any training, on an idle GPU


def check_and_record(name: str, out, seq_len: int, peaks: dict, extra: dict) -> dict:
    r = support.results(out)
    assert (r["distributed_type"], r["world_size"]) == ("NO", 1) and r["bf16"] is True
    losses = support.logged(out)
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]] - 0.5, losses  # it learns
    assert r["tokens_per_s_median"] > 0 and r["mfu_median"] > 0 and r["peak_mem_gb"] > 0
    numbers = {
        "tokens_per_s": r["tokens_per_s_median"],
        **mfu(r["tokens_per_s_median"], support.flops_per_token(out, seq_len), peaks),
        "mfu_hftrain_reported": r["mfu_median"],
        "peak_mem_gb": r["peak_mem_gb"],
        "first_loss": losses[steps[0]],
        "last_loss": losses[steps[-1]],
        "eval_loss": r["eval_loss"],
        "torch_compile": r["torch_compile"],
        "bf16": r["bf16"],
        "parameters": r["parameters"]["total"],
        "seq_len": seq_len,
        **{k: peaks[k] for k in ("device_name", "spec_card")},
        "spec_bf16_tflops": (peaks["spec_bf16_flops"] or 0) / 1e12 or None,
        "measured_bf16_tflops": peaks["measured_bf16_flops"] / 1e12,
        **extra,
    }
    assert numbers["mfu_measured"] > 0 and (numbers["mfu_spec"] is None or 0 < numbers["mfu_spec"] < 1)
    support.record(ITEM, name, numbers)
    return numbers


QUICKSTART_STEPS, PYTHIA_STEPS = 200, 30


def quickstart_recipe(out) -> dict:
    return support.shipped_recipe(
        "quickstart.yaml",
        out,
        max_steps=QUICKSTART_STEPS,
        bf16=True,
        torch_compile=True,
        save_steps=10_000,
        eval_steps=100,
        logging_steps=20,
    )


def pythia_recipe(out) -> dict:
    """The preset's shape, hyper-parameters and context; the built-in corpus (GPU hosts have no network); torch.compile
    left to hftrain's speed defaults (the benchmark measures the compiled 160m shape)."""
    raw = support.shipped_recipe(
        "pretrain/pythia-160m.yaml",
        out,
        max_steps=PYTHIA_STEPS,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        save_steps=10_000,
        eval_strategy="no",
        logging_steps=5,
    )
    raw["lr_schedule"].update(decay_steps=PYTHIA_STEPS, warmup_fraction=0.1)  # Pythia's schedule, over 30 steps
    raw["data"].update(train=[{"builtin": "python-docs"}], eval_blocks=8)
    return raw


def test_quickstart_bf16_compiled(tmp_path, peaks):
    out = tmp_path / "quickstart"
    raw = quickstart_recipe(out)
    support.hftrain("train", str(support.write_recipe(raw, tmp_path / "quickstart.yaml")))
    numbers = check_and_record(
        "quickstart_bf16_compile", out, raw["data"]["seq_len"], peaks, {"steps": QUICKSTART_STEPS}
    )
    assert numbers["torch_compile"] is True


def test_pythia_160m_at_2048_tokens(tmp_path, peaks):
    out = tmp_path / "pythia-160m"
    raw = pythia_recipe(out)
    assert raw["data"]["seq_len"] == 2048 and raw["model"]["preset"] == "pythia-160m"
    support.hftrain("train", str(support.write_recipe(raw, tmp_path / "pythia-160m.yaml")))
    numbers = check_and_record("pythia160m_seq2048", out, 2048, peaks, {"steps": PYTHIA_STEPS, "batch": 8})
    assert numbers["parameters"] > 150e6
