"""GPU tier, item 4: the throughput benchmark (benchmarks/throughput.py) against its run_clm-style baseline on
the GPU. scripts/gpu_check.sh runs the full benchmark itself; this test is a shorter run of the same code."""

from __future__ import annotations

import json
import sys

import pytest

from . import support

pytestmark = pytest.mark.gpu
ITEM = "benchmark"


def test_throughput_benchmark_against_run_clm_baseline(tmp_path):
    out = tmp_path / "bench.json"
    support.run(
        [
            sys.executable,
            "benchmarks/throughput.py",
            "--device",
            "cuda",
            "--shapes",
            "gpu-160m",
            "--steps",
            "12",
            "--log-steps",
            "4",
            "--json",
            str(out),
        ]
    )
    bench = json.loads(out.read_text())
    shape = bench["shapes"]["gpu-160m"]
    assert bench["device"] == "cuda" and shape["seq"] == 2048
    assert shape["hftrain"]["dtype"] == "bf16" and shape["baseline"]["tokens_per_s"] > 0 and shape["ratio"] > 0
    assert shape["hftrain"]["heldout"] < 11.0  # it learned something in 12 steps (ln 50304 = 10.8 at random init)
    support.record(
        ITEM,
        "throughput_short",
        {
            "ratio": shape["ratio"],
            **{
                f"{side}_{k}": shape[side][k]
                for side in ("hftrain", "baseline")
                for k in ("tokens_per_s", "mfu", "mfu_spec", "dtype", "compile", "heldout")
            },
        },
    )
