"""CPU training reuses its freed buffers (_compat.keep_freed_memory): a steady-state step does not page-fault
its activations in again. Without the pinned malloc thresholds this run took 227 and 375 minor faults per step on
an idle 2-core EPYC (tests/support/fault_count_run.py ... without; whether glibc's adaptive threshold ends low
depends on the process's history, and on a machine busy with other work it did not), and a 4 x 128 step took 56 ms
instead of 44. The median over steps is checked: a one-off growth of the heap (a new data window) is not the fault."""

from __future__ import annotations

import subprocess
import sys

import torch

from hftrain import _compat

from .support.cli import ROOT


def test_a_cpu_training_step_does_not_page_fault_its_buffers_in_again(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "fault_count_run.py"), str(ROOT), str(tmp_path), "with"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    faults = float(result.stdout.split("FAULTS_PER_STEP")[1].split()[0])
    assert faults < 20, (
        f"median {faults:.0f} minor page faults per training step: freed memory goes back to the kernel every step"
    )
    assert "memory: freed blocks up to 32 MB kept for reuse" in result.stdout  # the run says what it set


def test_nothing_changes_off_the_cpu(monkeypatch):
    def no_libc(*args, **kwargs):
        raise AssertionError("the C library was touched for a GPU run")

    monkeypatch.setattr(_compat.ctypes, "CDLL", no_libc)
    assert _compat.keep_freed_memory(torch.device("cuda", 0)) is None
    assert _compat.keep_freed_memory(torch.device("meta")) is None
