"""The GPU fast-path benchmark's CPU dry run (benchmarks/gpu_fast_path.py --dry-run): every side trains at a tiny
shape and its numbers land in the results file and the markdown table that a lent GPU appends to
docs/performance.md."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_fast_path import main


@pytest.mark.slow
def test_the_dry_run_measures_every_side_and_writes_the_table(tmp_path):
    docs = tmp_path / "performance.md"
    rows = main(["--dry-run", "--sides", "hftrain,trainer", "--out", str(tmp_path / "out"), "--docs", str(docs)])
    assert [row["side"] for row in rows] == ["hftrain", "trainer"]
    for row in rows:
        assert "error" not in row and row["tokens_per_s"] > 0 and 0 <= row["data_wait_frac"] <= 1
        assert row["graph_breaks"] == 0 and row["graphs"] >= 1  # each side compiled (aot_eager here), with no break
    env, *saved = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert env["device"] == "cpu (dry run)" and env["torch"] and env["transformers"] and env["date"]
    assert saved == rows
    table = docs.read_text()
    assert f"(torch {env['torch']}, transformers {env['transformers']})" in table
    assert "| cpu-tiny | trainer |" in table and "1.00x" in table
