"""`hftrain plan` with overrides anywhere on its command line."""

from __future__ import annotations

from ..support.cli import ROOT, in_process


def test_plan_with_overrides_anywhere(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, printed = in_process(capsys, "plan", "recipes/pretrain/pythia-1b.yaml")
    assert code == 0, printed
    assert "1,011,781,632 total" in printed and "FLOPs per token" in printed and "fp32" in printed
    code, moved = in_process(capsys, "plan", "model.preset=pythia-70m", "recipes/quickstart.yaml", "data.seq_len=64")
    assert code == 0, moved
    assert "model pythia-70m: 6 layers, hidden 512, 8 heads, vocab 4,096" in moved  # quickstart's 4k BPE


def test_plan_times_steps_by_a_last_run_only_when_it_measured_enough_steps(tmp_path):
    """Issue 63: a two-step run's MFU (start-up in its few intervals) made plan predict 33 s a step where a step
    took 0.14 s. A run's median goes into the prediction from 5 logged values on; below, the assumption, said.
    (`_mfu` is what plan's time line prints: "x MFU {mfu}, {source}".)"""
    import argparse
    import json

    from hftrain.cli.plan import _mfu
    from hftrain.planning.fit import this_machine
    from hftrain.recipe.load import load_recipe

    results = tmp_path / "results.json"
    recipe = load_recipe(str(ROOT / "recipes/quickstart.yaml"), [f"training.output_dir={tmp_path}"])
    args, machine = argparse.Namespace(mfu=None, gpus=None), this_machine()
    results.write_text(json.dumps({"mfu_median": 0.001, "mfu_samples": 2}))
    mfu, source = _mfu(args, recipe, machine)
    assert mfu == 0.5 and source.startswith("assumed for CPUs"), source
    assert source.endswith(f"; the last run in {results} logged 2 MFU value(s), too few to go by"), source
    results.write_text(json.dumps({"mfu_median": 0.25, "mfu_samples": 30}))
    assert _mfu(args, recipe, machine) == (0.25, f"measured by the last run in {results}")
