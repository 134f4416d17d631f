"""The GPU acceptance tier, checked where there is no GPU: the `gpu` marker's selection (listed by -m gpu, never
selected by other -m expressions, never passed without CUDA), scripts/gpu_check.sh's dry run and its report,
the spec-sheet peaks. What the gpu tests measure is only known on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.gpu_peaks import mfu, spec_bf16_tflops

from .support.cli import ROOT, in_background

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_report  # noqa: E402

ITEM_MODULES = {
    "training": "test_gpu_training",
    "finetune": "test_gpu_finetune",
    "backends": "test_gpu_backends",
    "benchmark": "test_gpu_benchmark",
    "plan": "test_gpu_plan",
    "packing": "test_gpu_packing",
    "fast_path": "test_gpu_fast_path",
}


def pytest_run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_gpu_tests_are_listed_by_m_gpu_and_never_selected_or_passed_otherwise():
    selections = ([], ["-m", "not slow"])  # addopts' -m 'not gpu'; a user's own -m, which replaces it
    runs = [
        in_background(lambda args=args: pytest_run(*args))
        for args in (  # 3 pytest processes at once: mostly imports; -v lists each gpu test with its outcome
            ["tests/gpu", "-m", "gpu", "-v", "-rs"],
            *(["tests/gpu", "--collect-only", "-q", *selection] for selection in selections),
        )
    ]
    ran, *others = (run.result() for run in runs)
    ids = [line.split()[0] for line in ran.stdout.splitlines() if "::" in line and " SKIPPED" in line]
    for module in ITEM_MODULES.values():  # at least one per acceptance item
        assert any(f"tests/gpu/{module}.py::" in i for i in ids), (module, ran.stdout[-2000:])
    for selection, other in zip(selections, others):
        out = other.stdout
        assert not [line for line in out.splitlines() if "::" in line], (selection, out[-1500:])
        assert f"{len(ids)} deselected" in out
    assert ran.returncode == 0 and f"{len(ids)} skipped" in ran.stdout and " passed" not in ran.stdout, ran.stdout[
        -1500:
    ]
    assert "gpu tier: no CUDA device here" in ran.stdout


@pytest.mark.slow
def test_gpu_check_dry_run_reports_the_environment_and_the_plan(tmp_path):
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path / "report")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "gpu_check: no GPU: dry run" in result.stdout and "benchmarks/throughput.py --device cuda" in result.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["verdict"] == "no GPU: dry run" and report["dry_run"] and not report["passed"]
    env = report["environment"]
    assert env["gpu_count"] == 0 and env["missing"] == [] and env["date"]
    assert all(env["versions"][p] for p in ("torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes"))
    for key, module in ITEM_MODULES.items():
        item = report["items"][key]
        assert item["status"] == "DRY RUN" and item["tests"] == [] and item["numbers"] == []
        assert item["planned"] and all(f"tests/gpu/{module}.py::" in t for t in item["planned"])
    md = (tmp_path / "report" / "report.md").read_text()
    assert (
        md.startswith("# hftrain GPU acceptance report: no GPU: dry run")
        and "- would run: `tests/gpu/test_gpu_backends.py::" in md
    )


SYNTHETIC = """
import pytest

def test_ok():
    pass

def test_world2():
    pytest.skip("needs 2 GPUs, this machine has 1")

def test_broken():
    assert 1 == 2
"""


@pytest.mark.slow
def test_report_statuses_from_a_real_junit_file(tmp_path):
    """A pytest run of stand-in gpu modules gives the junit.xml the report reads: passes, a skip for want of GPUs
    (does not fail the item), a failure (fails it), an item not run; numbers and the benchmark's result."""
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    for init in (tmp_path / "tests" / "__init__.py", gpu / "__init__.py"):
        init.write_text("")
    (gpu / "test_gpu_backends.py").write_text(
        textwrap.dedent(SYNTHETIC).replace("def test_broken():\n    assert 1 == 2\n", "")
    )
    (gpu / "test_gpu_finetune.py").write_text(textwrap.dedent(SYNTHETIC))
    # a module no item names: its failure still counts
    (gpu / "test_gpu_newcomer.py").write_text(textwrap.dedent(SYNTHETIC))
    pytest_run("tests", "-q", "-o", "addopts=", "--junitxml", str(tmp_path / "junit.xml"), cwd=tmp_path)
    (tmp_path / "items").mkdir()
    (tmp_path / "items" / "fsdp_world1.json").write_text(
        json.dumps({"item": "backends", "test": "fsdp_world1", "numbers": {"resume_max_rel_loss_diff": 0.0}})
    )
    bench = {
        "shapes": {
            "gpu-160m": {
                "ratio": 1.5,
                **{
                    s: {
                        "tokens_per_s": 1e5,
                        "mfu": 0.3,
                        "mfu_spec": 0.2,
                        "dtype": "bf16",
                        "compile": True,
                        "heldout": 7.0,
                    }
                    for s in ("hftrain", "baseline")
                },
            }
        }
    }
    (tmp_path / "benchmark.json").write_text(json.dumps(bench))
    assert gpu_report.main([str(tmp_path), "--bench-rc", "0"]) == 1  # not all items passed
    report = json.loads((tmp_path / "report.json").read_text())
    status = {k: v["status"] for k, v in report["items"].items()}
    assert status == {
        "backends": "PASS",
        "finetune": "FAIL",
        "training": "NOT RUN",
        "benchmark": "PASS",
        "plan": "NOT RUN",
        "packing": "NOT RUN",
        "fast_path": "NOT RUN",
        "other": "FAIL",
    }
    assert [t["id"] for t in report["items"]["other"]["tests"] if t["outcome"] == "failed"] == [
        "tests.gpu.test_gpu_newcomer::test_broken"
    ]
    assert report["verdict"] == "FAIL" and report["items"]["backends"]["numbers"][0]["test"] == "fsdp_world1"
    assert report["items"]["benchmark"]["numbers"][0]["numbers"]["ratio"] == 1.5
    md = (tmp_path / "report.md").read_text()
    assert (
        "## finetune: FAIL" in md
        and "- skipped: `tests.gpu.test_gpu_backends::test_world2`" in md
        and "ratio 1.5" in md
    )
    assert gpu_report.main([str(tmp_path), "--bench-rc", "1"]) == 1
    assert json.loads((tmp_path / "report.json").read_text())["items"]["benchmark"]["status"] == "FAIL"
    # nothing failed but some items did not run (a machine without a kernel they need): INCOMPLETE, not PASS
    for module in ("test_gpu_finetune.py", "test_gpu_newcomer.py"):
        (gpu / module).unlink()
    pytest_run("tests", "-q", "-o", "addopts=", "--junitxml", str(tmp_path / "junit.xml"), cwd=tmp_path)
    assert gpu_report.main([str(tmp_path), "--bench-rc", "0"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "INCOMPLETE" and "other" not in report["items"], report["items"].keys()
    assert (tmp_path / "report.md").read_text().startswith("# hftrain GPU acceptance report: INCOMPLETE")


def test_report_checks_every_requirement_floor(monkeypatch):
    """The environment check reads hftrain's floors from pyproject.toml (a floor written into the script went stale)."""
    assert gpu_report.below_floor() == []  # this environment meets them
    real = gpu_report.version
    monkeypatch.setattr(gpu_report, "version", lambda name: "0.1" if name == "peft" else real(name))
    assert gpu_report.below_floor() == ["peft>=0.18 (found 0.1)"]


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", None),
        ("NVIDIA H100 NVL", None),
        ("Tesla T4", None),
    ],
)
def test_spec_sheet_bf16_peaks_by_device_name(name, tflops):
    assert spec_bf16_tflops(name)[0] == tflops
    numbers = mfu(1000.0, 1e9, {"spec_bf16_flops": tflops and tflops * 1e12, "measured_bf16_flops": 5e14})
    assert numbers["mfu_measured"] == pytest.approx(1e12 / 5e14)
    # unknown GPU: measured peak only
    assert numbers["mfu_spec"] == (pytest.approx(1e12 / (tflops * 1e12)) if tflops else None)


def test_the_gpu_tests_recipes_validate(tmp_path):
    """Typos in a gpu test's recipe should not wait for a GPU to show: each recipe the tier trains validates here."""
    import hftrain

    from .gpu import test_gpu_backends, test_gpu_finetune, test_gpu_training

    recipes = [
        test_gpu_training.quickstart_recipe(tmp_path / "q"),
        test_gpu_training.pythia_recipe(tmp_path / "p"),
        test_gpu_backends.small_recipe(tmp_path, tmp_path / "b"),
    ]
    recipes += [test_gpu_finetune.recipe(tmp_path / "base", m, tmp_path / m) for m in test_gpu_finetune.METHODS]
    for raw in recipes:
        recipe = hftrain.load_recipe(None, raw)
        assert recipe.training.output_dir.startswith(str(tmp_path))
    pythia = hftrain.load_recipe(None, recipes[1])
    assert pythia.data.seq_len == 2048 and pythia.model.preset == "pythia-160m" and pythia.training.bf16


def test_every_benchmark_shape_is_a_recipe_hftrain_accepts(tmp_path):
    """The first GPU run found gpu-160m (2,048 tokens) refused by hftrain: its model kept a 1,024-token context.
    Every shape's hftrain recipe goes through the same checks `hftrain train` makes before the model is built."""
    import hftrain
    from benchmarks import throughput
    from benchmarks._loop import context
    from hftrain.model.config import check_context, recipe_config
    from hftrain.model.part import ModelPart

    for name, shape in throughput.SHAPES.items():
        raw = throughput.hftrain_recipe(shape, tmp_path / name, 2000, 5, tmp_path / "docs")
        part = ModelPart.of(hftrain.load_recipe(None, raw))
        check_context(part, recipe_config(part, 50_257, False))  # raises on the failure the GPU run met
        assert context(shape) >= shape["seq"], name
