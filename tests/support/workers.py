"""The suite on several pytest-xdist workers (pyproject's addopts: one per CPU core this process may use).

Each worker is its own pytest session, so a session fixture would be built once per worker. `built_once` makes the
expensive ones (trained runs, launches) built once per test run: the first worker to need one builds it under a
file lock in a folder every worker of the run shares, and the others wait for it and read what it returned.
Without xdist (`-n 0`, or a single test) it is an ordinary session-scoped build.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def worker_count() -> int:
    """How many workers this test run has (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def cores() -> int:
    """The CPU cores this process may run on (a container's or taskset's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_temp_root(factory: pytest.TempPathFactory) -> Path:
    """The temp folder every worker of this test run shares: pytest-N/, the parent of each worker's popen-gwK (the
    session's own basetemp without xdist)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """build(empty folder) once per test run, shared by every worker; `name` must be unique in the run and what
    `build` returns picklable. Tests only read what it built (a folder is never written after `build`)."""
    if worker_count() == 1:
        return build(factory.mktemp(name))
    from filelock import FileLock

    shared = run_temp_root(factory) / "built-once"
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.pickle"
    with FileLock(str(shared / f"{name}.lock")):
        if done.exists():
            return pickle.loads(done.read_bytes())
        folder = shared / name
        folder.mkdir()
        value = build(folder)
        done.write_bytes(pickle.dumps(value))
        return value
