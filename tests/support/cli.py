"""Running hftrain as a user would: `python -m hftrain ...` in a subprocess, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

# What accelerate must really set up for each shipped backend (a silent fallback to DDP or one process fails).
EXPECTED_TYPE = {"ddp": "MULTI_CPU", "fsdp": "FSDP", "zero3": "DEEPSPEED"}


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m hftrain ARGS` as a user would, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "hftrain", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def launch(recipe: Path, backend: str, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`hftrain train RECIPE` with 2 processes on `backend` into `out`; asserts it succeeded."""
    result = run_cli("train", str(recipe), "--accelerate-config", backend, "--nproc", "2",
                     f"training.output_dir={out}", *overrides)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result
