"""The suite leaves no disk behind: CI runs one after another on one machine, and leftovers filled its disk (a failed
CI: `No space left on device` while installing the lowest versions' venv)."""

from __future__ import annotations

import os
from pathlib import Path

from .support.workers import run_temp_root


def test_torch_compile_caches_in_the_sessions_own_temp_dir(tmp_path_factory):
    """Inductor's default cache (/tmp/torchinductor_<user>) gained a 155 MB precompiled header per fresh venv."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert Path(cache_dir()).resolve().is_relative_to(run_temp_root(tmp_path_factory).resolve()), cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache_dir()  # what every run a test starts inherits


def test_a_passed_tests_temp_dir_is_removed(request):
    """Kept, each run's venvs, checkpoints and caches left 5.5 GB in /tmp/pytest-of-<user>; pytest keeps 3 runs."""
    assert request.config.getini("tmp_path_retention_policy") == "failed"
