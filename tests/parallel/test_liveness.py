"""A multi-process run that stops moving with every process alive says so, and where (parallel/liveness.py)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

from hftrain.parallel import launcher_store, liveness


def test_a_run_without_a_finished_step_reports_each_ranks_step_and_this_processes_threads(monkeypatch, capfd):
    """Two heartbeats, ranks 0 and 1 of one run, in the launcher's store; rank 0 stays at step 3 and rank 1 at step
    2 (ranks waiting in collectives that do not match). Within the stall limit each says which step every rank is
    at and where its threads are, and neither ends the run (every beat moves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "false",
        "RANK": "0",
        liveness.STALL_REPORT_ENV: "1.5",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(launcher_store._rounds, launcher_store._start(), "hftrain/stall-test/")  # both ranks joined
    beats = [
        liveness.Heartbeat(
            SimpleNamespace(rank=r, processes=2, nodes=1), lambda: "no checkpoint", step=lambda s=3 - r: s
        )
        for r in (0, 1)
    ]
    try:
        deadline, err = time.monotonic() + 30, ""
        while time.monotonic() < deadline and err.count("no optimizer step finished") < 2:
            time.sleep(0.5)
            err += capfd.readouterr().err
    finally:
        for beat in beats:
            beat.stop()
    assert "hftrain: rank 0: no optimizer step finished for 2 s (rank 0 at step 3, rank 1 at step 2)" in err, err[
        -3000:
    ]
    assert "hftrain: rank 1: no optimizer step finished for 2 s (rank 0 at step 3, rank 1 at step 2)" in err, err[
        -3000:
    ]
    assert 'File "' in err and "test_liveness.py" in err  # the stacks: the test's own thread is waiting in this file
