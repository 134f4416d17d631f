"""Command-line values that cannot work (class 6 of the third pass): bounds live where a value is parsed
(hftrain/cli/numbers.py), so nothing starts with them; and --max-restarts restarts only what a restart can fix."""

from __future__ import annotations

import ast
import subprocess
import sys
import time

import pytest

from hftrain.cli import main

from ..support.checks import tree_digest
from ..support.cli import ROOT

# (name, argv with {recipe} and {tmp}, expected message)
# (name, argv with {recipe} and {tmp}, expected message)
VALUES = [
    (
        "launch-script --nodes 0",
        ["launch-script", "{recipe}", "--nodes", "0"],
        "argument --nodes: 0 cannot work: give a whole number of 1 or more",
    ),
    (
        "--gpus-per-node -1",
        ["launch-script", "{recipe}", "--gpus-per-node", "-1"],
        "argument --gpus-per-node: -1 cannot work",
    ),
    (
        "--instance-count 0",
        ["launch-script", "{recipe}", "--kind", "sagemaker", "--instance-count", "0"],
        "argument --instance-count: 0 cannot work",
    ),
    (
        "train --nproc 0",
        ["train", "{recipe}", "--accelerate-config", "ddp", "--nproc", "0"],
        "argument --nproc: 0 cannot work: give a whole number of 1 or more",
    ),
    (
        "train --nproc -1",
        ["train", "{recipe}", "--accelerate-config", "ddp", "--nproc", "-1"],
        "argument --nproc: -1 cannot work",
    ),
    (
        "--max-restarts -1",
        ["train", "{recipe}", "--max-restarts", "-1"],
        "argument --max-restarts: -1 cannot work: give a whole number of 0 or more",
    ),
    (
        "--max-restarts two",
        ["train", "{recipe}", "--max-restarts", "two"],
        "argument --max-restarts: 'two' is not a whole number",
    ),
    (
        "plan --mfu 35",
        ["plan", "{recipe}", "--mfu", "35"],
        "argument --mfu: 35 cannot work: give a number above 0 and at most 1",
    ),
    ("plan --gpus 0", ["plan", "{recipe}", "--gpus", "0"], "argument --gpus: 0 cannot work"),
    (
        "plan --gpu-mem-gb nan",
        ["plan", "{recipe}", "--gpus", "8", "--gpu-mem-gb", "nan"],
        "argument --gpu-mem-gb: nan cannot work: give a number above 0",
    ),
    (  # before: accepted, and the plan printed a cost of $inf
        "plan --price-per-hour inf",
        ["plan", "{recipe}", "--price-per-hour", "inf"],
        "argument --price-per-hour: inf cannot work: give a number above 0",
    ),
    ("parity --steps 0", ["parity", "{recipe}", "--steps", "0"], "argument --steps: 0 cannot work"),
    (
        "data prepare --workers 0",
        ["data", "prepare", "{recipe}", "--out", "{tmp}/shards", "--workers", "0"],
        "argument --workers: 0 cannot work",
    ),
    ("eval --stride 0", ["eval", "{tmp}", "--stride", "0"], "argument --stride: 0 cannot work"),
    (
        "train_tokens 10^30",
        ["train", "{recipe}", "training.max_steps=-1", "data.train_tokens=1000000000000000000000000000000"],
        "data.train_tokens: 1,000,000,000,000,000,000,000,000,000,000 training tokens is more than hftrain trains (at "
        "most 1,000,000,000,000,000)",
    ),
    (
        "seq_len 10^9",
        ["train", "{recipe}", "data.seq_len=1000000000"],
        "data.seq_len: 1,000,000,000 tokens per sequence is more "
        "than hftrain trains (at most 1,048,576); check the number",
    ),
    (
        "seq_len 10^9 in plan",
        ["plan", "{recipe}", "data.seq_len=1000000000"],
        "data.seq_len: 1,000,000,000 tokens per sequence",
    ),
]


@pytest.mark.parametrize("name, argv, expected", VALUES, ids=[c[0] for c in VALUES])
def test_a_value_that_cannot_work_is_refused_where_it_is_parsed(capsys, work, name, argv, expected):
    before = tree_digest(work)
    started = time.monotonic()
    try:
        code = main([a.format(recipe=work / "r.yaml", tmp=work) for a in argv])
    except SystemExit as exit_:  # argparse's own refusal
        code = exit_.code
    took = time.monotonic() - started
    printed = capsys.readouterr()
    assert code == 2, (code, printed.err[-2000:])
    assert expected in printed.err and "Traceback" not in printed.err + printed.out, printed.err[-2000:]
    assert took < 10, took
    assert tree_digest(work) == before  # nothing written, nothing started


def test_every_numeric_option_is_bounded():
    """A plain type=int / type=float option would take 0 or -1 again; the check can fail (see the last line)."""

    def plain_numbers(source: str) -> list[int]:
        return [
            kw.value.lineno
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call)
            for kw in node.keywords
            if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float")
        ]

    found = {p.name: plain_numbers(p.read_text()) for p in (ROOT / "hftrain" / "cli").glob("*.py")}
    assert not any(found.values()), found
    assert plain_numbers('p.add_argument("--nodes", type=int, default=2)') == [1]


# ------------------------------------------------------------------------------------------- --max-restarts
# ------------------------------------------------------------------------------------------- --max-restarts
_CHILD = """import os, signal, sys
from pathlib import Path
log = Path(sys.argv[1]); codes = sys.argv[2].split(",")
runs = len(log.read_text().split()) if log.exists() else 0
log.write_text(log.read_text() + " run" if log.exists() else "run")
code = codes[min(runs, len(codes) - 1)]
if code == "KILL":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(code))
"""


@pytest.mark.parametrize(
    "codes, expected_runs, expected_exit",
    [
        ("2", 1, 2),  # a configuration error fails the same way every time: never restarted
        ("0", 1, 0),
        ("130", 1, 130),
        ("KILL,0", 2, 0),
        ("75,0", 2, 0),
        ("1,1,0", 3, 0),  # a crash, a preemption of the child alone, a bug: restarted
        ("KILL,2", 2, 2),  # restarted after the crash, then the configuration error is final
        ("1,1,1,1", 3, 1),  # no restarts left
    ],
)
def test_max_restarts_restarts_only_what_a_restart_can_fix(tmp_path, capsys, codes, expected_runs, expected_exit):
    from hftrain.launch.processes import supervise

    log = tmp_path / "runs.txt"
    code = supervise([str(log), codes], 2, command=[sys.executable, "-c", _CHILD])
    assert (code, len(log.read_text().split())) == (expected_exit, expected_runs)
    err = capsys.readouterr().err
    if codes == "2":
        assert "hftrain: not restarted: a problem in the recipe or data (a restart would fail the same way)." in err
        assert "restart 1" not in err


@pytest.mark.slow
def test_max_restarts_does_not_rerun_a_configuration_error(tmp_path, recipe_file):
    """Found by the child process (the recipe itself is valid: the data file's first record is not JSON): exit 2
    once, not N + 1 times."""
    data = tmp_path / "good.jsonl"
    data.write_text("{not json\n" + data.read_text(encoding="utf-8"), encoding="utf-8")
    before = data.read_bytes()
    result = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", str(recipe_file), "--max-restarts", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr.count(f"{data}:1: not valid JSON") == 1, result.stderr[-2000:]
    assert (
        "hftrain: not restarted: a problem in the recipe or data" in result.stderr
        and "restart 1 of" not in result.stderr
    )
    assert "Traceback" not in result.stderr and data.read_bytes() == before
