"""The throughput benchmark's turn-taking (benchmarks/_turns.py): the sides of a pair never compute at the same
time, each turn is the stated number of steps, the waits are left out of the step times, and a side that dies
fails the benchmark with its log instead of leaving the others waiting forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks._common import steady_state, step_durations
from benchmarks._turns import run_in_turns

from .support.cli import ROOT

# A side: `steps` steps of ~20 ms of busy work each, its turns taken as throughput.py's sides take them.
SIDE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    from benchmarks._turns import Turns
    out, steps, crash_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    open(out + ".pid", "w").write(str(__import__("os").getpid()))
    turns = Turns.from_env()
    spans, waited = [], []
    for step in range(1, steps + 1):
        if step == crash_at:
            sys.exit(3)
        begin = time.perf_counter()
        while time.perf_counter() - begin < 0.02:
            pass
        spans.append((begin, time.perf_counter()))
        waited.append(turns.after_step(step, steps) if turns else 0.0)
    json.dump({{"spans": spans, "waited": waited}}, open(out, "w"))
    if turns and not {skip_finish}:
        turns.finished()
""")


def _sides(tmp_path: Path, count: int, steps: int, crash: dict[int, int] | None = None, skip_finish: bool = False):
    script = tmp_path / "side.py"
    script.write_text(SIDE.format(root=str(ROOT), skip_finish=skip_finish))
    crash = crash or {}
    cmds = [
        [sys.executable, str(script), str(tmp_path / f"side-{i}.json"), str(steps), str(crash.get(i, 0))]
        for i in range(count)
    ]
    return cmds, [tmp_path / f"side-{i}.log" for i in range(count)]


def test_sides_take_turns_of_the_stated_steps_and_never_overlap(tmp_path):
    cmds, logs = _sides(tmp_path, 3, 12)
    run_in_turns(cmds, logs, tmp_path / "turns", every=4, env=dict(os.environ))
    results = [json.loads((tmp_path / f"side-{i}.json").read_text()) for i in range(3)]
    steps = sorted((begin, end, side) for side, r in enumerate(results) for begin, end in r["spans"])
    for (_, end, _), (begin, _, _) in zip(steps, steps[1:]):
        assert begin >= end, "two sides computed at the same time"
    order = [side for _, _, side in steps]
    assert order == [0] * 4 + [1] * 4 + [2] * 4 + [0] * 4 + [1] * 4 + [2] * 4 + [0] * 4 + [1] * 4 + [2] * 4
    for r in results:  # a wait after steps 4 and 8 (2 other sides' turns of ~80 ms each); none after the last step
        assert [w > 0.1 for w in r["waited"]] == [False, False, False, True] * 2 + [False] * 4


def test_the_wait_for_a_turn_is_not_step_time():
    clock = {
        "train_begin": 0.0,
        "step_end": [1.0, 2.0, 12.0, 13.0, 14.0],
        "waited": [0.0, 9.0, 0.0, 0.0, 0.0],
        "cpu": [2.0, 4.0, 6.0, 8.0, 10.0],
    }
    assert step_durations(clock) == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert steady_state(clock, 100)["tokens_per_s"] == 100.0
    assert steady_state(clock, 100)["cpu_util"] == pytest.approx(2.0)
    del clock["waited"]  # a clock without turns: the 9 s count, as they would
    assert step_durations(clock)[2] == 10.0


def _parent_code(tmp_path: Path, cmds: list[list[str]], logs: list[Path]) -> str:
    return (
        f"import sys, os, json; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
        f"from benchmarks._turns import run_in_turns; "
        f"run_in_turns(json.loads({json.dumps(cmds)!r}), [Path(p) for p in {[str(p) for p in logs]!r}], "
        f"Path({str(tmp_path / 'turns')!r}), 4, dict(os.environ), poll_s=0.1)"
    )


def _run_parent(tmp_path: Path, cmds: list[list[str]], logs: list[Path]) -> subprocess.CompletedProcess:
    """run_in_turns in a process of its own, under a timeout: a parent that waited forever fails here."""
    return subprocess.run(
        [sys.executable, "-c", _parent_code(tmp_path, cmds, logs)], capture_output=True, text=True, timeout=60
    )


def test_a_side_that_dies_fails_the_benchmark_with_its_log(tmp_path):
    cmds, logs = _sides(tmp_path, 2, 12, crash={1: 6})  # side 1 dies during its second turn, side 0 waits
    result = _run_parent(tmp_path, cmds, logs)
    assert result.returncode != 0
    assert "benchmark child failed (exit 3)" in result.stderr and str(logs[1]) in result.stderr


def test_a_side_that_ends_without_saying_it_finished_fails(tmp_path):
    cmds, logs = _sides(tmp_path, 2, 4, skip_finish=True)  # one turn each, then exit 0 without "finished"
    result = _run_parent(tmp_path, cmds, logs)
    assert result.returncode != 0
    assert "benchmark child failed (exit 0)" in result.stderr


def test_sides_end_when_the_benchmark_is_killed(tmp_path):
    cmds, logs = _sides(tmp_path, 2, 400)  # 8 s of steps each: far longer than the test waits
    parent = subprocess.Popen([sys.executable, "-c", _parent_code(tmp_path, cmds, logs)])
    pid_files = [tmp_path / f"side-{i}.json.pid" for i in range(2)]
    deadline = time.monotonic() + 30
    while not all(p.is_file() and p.read_text() for p in pid_files):  # side 1 starts when side 0 has had a turn
        assert time.monotonic() < deadline and parent.poll() is None, "the sides never both started"
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    pids = [int(p.read_text()) for p in pid_files]
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids):  # the one waiting for a turn notices within 2 s; the other's next wait
        assert time.monotonic() < deadline, "a side kept waiting for a turn after the benchmark was killed"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
