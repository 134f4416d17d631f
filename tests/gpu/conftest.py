"""The GPU acceptance tier (tests marked `gpu`): selected only when the -m expression names gpu, and then
skipped, never passed, without CUDA.

pyproject's addopts carry `-m 'not gpu'`, but a user's own -m replaces it (`pytest -m "not slow"` would
otherwise select these tests on a CPU machine); so any run whose -m does not mention gpu deselects them here.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    if "gpu" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=gpu_items)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(
            reason="gpu tier: no CUDA device here (run it on a GPU machine: bash scripts/gpu_check.sh)"
        )
        for item in gpu_items:
            item.add_marker(skip)
