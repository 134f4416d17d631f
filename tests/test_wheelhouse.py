"""Offline install (scripts/wheelhouse.py): the plan for a named Python and platform, what --no-torch leaves out,
and, end to end, a wheelhouse built here that installs hftrain into a fresh venv with pip --no-index alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .support.cli import ROOT, in_background

sys.path.insert(0, str(ROOT / "scripts"))
import wheelhouse  # noqa: E402

SCRIPT = ROOT / "scripts" / "wheelhouse.py"


def test_plan_for_a_named_python_and_platform(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(tmp_path / "wh"),
            "--python-version",
            "3.12",
            "--platform",
            "manylinux2014_x86_64",
            "--no-torch",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pip wheel --no-deps --wheel-dir" in out and "deepspeed>=0.16" in out  # PyPI has no DeepSpeed wheel
    download = next(line for line in out.splitlines() if " download " in line)
    for flag in (
        "--only-binary=:all:",
        "--python-version 3.12",
        "--implementation cp",
        "--abi cp312",
        "--platform manylinux_2_17_x86_64",
        "--platform manylinux2014_x86_64",
        "--platform manylinux1_x86_64",
        "--constraint",
        "hftrain-0.1.0-py3-none-any.whl[deepspeed,qlora]",
    ):
        assert flag in download, flag
    assert "--platform manylinux_2_28_x86_64" not in download  # no newer glibc than asked
    assert f"install offline: pip install --no-index --find-links {tmp_path / 'wh'} 'hftrain[deepspeed,qlora]'" in out
    assert "warning: target Python 3.12" in result.stderr or sys.version_info[:2] == (3, 12)
    assert not (tmp_path / "wh").exists()  # a dry run downloads nothing
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--extras", "qlora,cuda", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert (
        bad.returncode == 2
        and "unknown extra(s) cuda; hftrain has deepspeed, qlora, eval, dpo, fp8, gcs, sagemaker, ray, trackers, test"
        in bad.stderr
    )


def test_no_torch_leaves_out_torch_and_the_cuda_libraries_but_not_nvml(tmp_path):
    names = [
        "torch-2.11.0+hftrainstub-py3-none-any.whl",
        "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "triton-3.5.0-cp312-cp312-manylinux_2_27_x86_64.whl",
        "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
        "nvidia_ml_py-13.580.82-py3-none-any.whl",
        "numpy-2.4.6-cp312-cp312-manylinux_2_28_x86_64.whl",
        "pyarrow-26.0.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    dropped = wheelhouse.prune(tmp_path, no_torch=True, exclude=["PyArrow"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[4], names[5], names[7]])
    assert len(dropped) == 5
    stub = wheelhouse.stub_torch(tmp_path, "2.11.0")
    assert stub.name == "torch-2.11.0+hftrainstub-py3-none-any.whl"
    assert wheelhouse.platforms("macosx_14_0_arm64") == ["macosx_14_0_arm64"]
    assert wheelhouse.platforms("manylinux_2_28_aarch64")[:2] == ["manylinux_2_28_aarch64", "manylinux_2_27_aarch64"]


def offline_env() -> dict[str, str]:
    """pip with no index, no links and no constraints from this machine's configuration: the wheelhouse alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


@pytest.mark.slow(seconds=200)  # the suite's order: the longest files start first (tests/conftest.py)
def test_wheelhouse_installs_hftrain_offline_into_a_fresh_venv(tmp_path, newer_torch_plan):
    """About 3-4 minutes: download (~230 MB without torch), a fresh venv with the local CPU torch, the offline
    install."""
    wh = tmp_path / "wh"
    built = subprocess.run(
        [sys.executable, str(SCRIPT), str(wh), "--no-torch"], capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    files = sorted(p.name for p in wh.glob("*.whl"))
    assert not [f for f in files if f.startswith(("torch-", "triton-", "nvidia_cu", "nvidia_cublas"))]
    assert "hftrain-0.1.0-py3-none-any.whl" in files and any(
        f.startswith("deepspeed-") and f.endswith("-py3-none-any.whl") for f in files
    )
    assert any(f.startswith("bitsandbytes-") for f in files) and any(f.startswith("setuptools-") for f in files)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # as the README
    torch = subprocess.run(
        # --no-compile: no .pyc for torch's 20,000 files up front (minutes of one core; import compiles what it reads)
        [py, "-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert torch.returncode == 0, torch.stderr[-2000:]
    check = subprocess.run([py, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    assert check.stdout.strip() == "None"  # a CPU build; the CUDA wheels were never pulled
    install = subprocess.run(
        [py, "-m", "pip", "install", "--no-compile", "--no-index", "--find-links", str(wh), "hftrain[deepspeed,qlora]"],
        capture_output=True,
        text=True,
        timeout=600,
        env=offline_env(),
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert f"Looking in links: {wh}" in install.stdout and "/opt/" not in install.stdout
    imported = subprocess.run(
        [py, "-c", "import hftrain, deepspeed, bitsandbytes, peft, datasets; print(hftrain.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=offline_env(),
        timeout=300,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert str(venv) in imported.stdout  # the installed wheel, not this checkout


def plan_beside_a_newer_torch(tmp_path) -> dict[str, str]:
    """pip's plan for `pip install -e .` in a venv that holds a metadata-only torch 2.15.0 (the newest release):
    {package: version} of what it would install."""
    import json

    stub = wheelhouse.stub_torch(tmp_path, "2.15.0")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    # hftrain's requirements alone: a machine-wide pip constraint (some hosts cap torch in /etc/xdg/pip) is not ours
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    subprocess.run([*pip, "install", "-q", "--no-index", str(stub)], check=True, timeout=300, env=env)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [*pip, "install", "--dry-run", "-q", "--report", str(report), "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }


@pytest.fixture(scope="module")
def newer_torch_plan(tmp_path_factory):
    """Started at the module's first slow test, beside the wheelhouse download: both are pip on one core, waiting
    on the network and the disk most of the time (one after the other they took 177 s + 51 s on 2 cores)."""
    return in_background(lambda: plan_beside_a_newer_torch(tmp_path_factory.mktemp("newer-torch")))


@pytest.mark.slow
def test_installs_beside_a_newer_torch_without_replacing_it(newer_torch_plan):
    """A GPU image's torch (here a metadata-only torch 2.15.0, the newest release) stays: pip's plan for
    `pip install -e .` holds hftrain and its requirements and no torch. (With the old `torch<=2.14.1` it planned to
    replace it with 2.14.1, a multi-GB CUDA build.)"""
    planned = newer_torch_plan.result()
    assert "hftrain" in planned and "transformers" in planned
    assert "torch" not in planned, f"pip would replace torch 2.15.0 with {planned.get('torch')}"
