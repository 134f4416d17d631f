"""Shared test fixtures: a small generated corpus, tiny recipes, one tiny pretrained model and one short quickstart
model per session; and the
fake servers' fixtures (local_hub, s3_server, s3, gcs, silent_server) and the slow tests' shared reference runs
(reference_runs.py) from tests/support, registered here by `pytest_plugins`.

Helpers that tests import (data, recipes, running the CLI, shared checks) live in tests/support, not here."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A multi-process run that stops moving says where every rank and thread is (parallel/liveness.py) within 2 minutes,
# long before a test's timeout: a hang in CI leaves its stacks in the failure's output.
os.environ.setdefault("HFTRAIN_STALL_REPORT_S", "120")

# Before tests.support is imported: its plain `assert`s then report their values like the tests' own.
pytest.register_assert_rewrite("tests.support")

from .support.data import make_documents, tiny_recipe, write_jsonl  # noqa: E402
from .support.workers import built_once, cores, run_temp_root, worker_count  # noqa: E402

if worker_count() > 1:  # several xdist workers share the cores: each its share, and so every run it starts
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // worker_count())))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The one place fixtures from tests/support are registered: each module holds a fake server and its fixtures.
pytest_plugins = [
    "tests.support.hub",
    "tests.support.s3",
    "tests.support.gcs",
    "tests.support.silent",
    "tests.support.reference_runs",
]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core this process may use (measured on 2 cores: the suite
    in 32 minutes on 2 workers against 44 on one; most of a test's time is imports and launches on one core).
    The GPU tier (`-m gpu`) shares one GPU: one worker."""
    if "gpu" in config.option.markexpr.replace("not gpu", ""):
        return 1
    return cores()


FAST_TEST_S, SLOW_TEST_S = 1.0, 30.0  # a test's rough seconds on 2 cores, for the order only


def expected_seconds(item: pytest.Item) -> float:
    """A test's rough duration: a slow test far longer than most says so, `@pytest.mark.slow(seconds=300)`."""
    slow = item.get_closest_marker("slow")
    return FAST_TEST_S if slow is None else float(slow.kwargs.get("seconds", SLOW_TEST_S))


def pytest_configure(config: pytest.Config) -> None:
    """pytest-xdist 3.7+ sorts the files by their number of tests unless told not to (--loadscope-reorder is its
    default), which scheduled the few-test, several-minute files (the quickstart, the wheelhouse) last: one worker
    then ran them alone at the end. The suite keeps its own order (below); older xdist has no such option."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-order",
        default="longest",
        help="longest (the default: the longest files first), reversed (files and each file's tests in the reverse "
        "of that), or shuffle:SEED (both shuffled): the suite must pass in any order (no test depends on another's "
        "state in the same process)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (their tests' expected seconds summed), each file's tests in their own order (module
    fixtures built once): the workers start on the long tests and finish on short ones instead of one worker
    ending alone. `--test-order` runs the same tests in another order, to show none depends on what ran before."""
    total: dict[Path, float] = {}
    for item in items:
        total[item.path] = total.get(item.path, 0.0) + expected_seconds(item)
    items.sort(key=lambda item: -total[item.path])
    order = config.getoption("--test-order")
    if order == "longest":
        return
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    groups = list(files.values())
    if order == "reversed":
        groups = [group[::-1] for group in groups[::-1]]
    elif order.startswith("shuffle:"):
        import random

        rng = random.Random(order.split(":", 1)[1])
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
    else:
        raise pytest.UsageError(f"--test-order: {order!r} is not longest, reversed or shuffle:SEED")
    items[:] = [item for group in groups for item in group]


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One hftrain cache (speed probe, parsed built-in corpora) per test session, for this process and every run
    it starts: each test session measures what it needs once, and never reads a measurement an earlier session (or
    the user's own runs in ~/.cache/hftrain) left."""
    cache = tmp_path_factory.mktemp("hftrain-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HFTRAIN_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def own_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torch.compile's cache (TorchInductor's, /tmp/torchinductor_<user> by default) in this test session's own
    temp dir, one for all its workers and every run they start: a session never reads what an earlier one compiled,
    and it leaves nothing behind (pyproject's tmp_path_retention_policy removes the dir of a session that passed).
    In the default place, each fresh venv added a 155 MB precompiled header that nothing removed: CI runs on one
    machine filled its disk."""
    cache = run_temp_root(tmp_path_factory) / "torchinductor"
    cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus" / "train.jsonl", make_documents(600))


@pytest.fixture
def make_recipe(corpus: Path, tmp_path: Path) -> Callable[..., Any]:
    """make_recipe(**training) -> validated Recipe for a tiny run in tmp_path/run."""
    from hftrain.recipe.load import load_recipe

    def make(**training: Any) -> Any:
        raw = tiny_recipe(corpus, tmp_path / "run", **training)
        return load_recipe(None, raw)

    return make


@pytest.fixture(scope="session")
def pretrained_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One tiny model trained once per test session (30 steps), shared by tests that need trained weights."""
    import hftrain

    root = tmp_path_factory.mktemp("pretrained")
    data = write_jsonl(root / "train.jsonl", make_documents(600))
    recipe = hftrain.load_recipe(None, tiny_recipe(data, root / "run"))
    return hftrain.train(recipe)


@pytest.fixture(scope="session")
def docs_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short quickstart: the shipped recipe's model and tokenizer, on the standard library's docstrings (60 steps,
    trained once per session): what the DPO tests start from, and the base the LoRA notebook finds where the
    quickstart leaves its model."""

    def build(root: Path) -> Path:
        import hftrain
        from hftrain.recipe.load import load_recipe

        raw = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"), None).model_dump(
            exclude_unset=True
        )
        raw["training"].update(
            output_dir=str(root),
            max_steps=60,
            save_steps=60,
            eval_strategy="no",
            report_to="none",
            disable_tqdm=True,
            bf16=False,
            torch_compile=False,
            logging_steps=40,
        )
        raw["monitor"] = {"plot": False, "sample_max_new_tokens": 0, "peak_tflops": 0.1}
        return hftrain.train(load_recipe(None, raw)).final_dir

    return built_once(tmp_path_factory, "docs-model", build)
