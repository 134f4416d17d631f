"""Helpers of the GPU tier: run hftrain as a user would (CLI, accelerate launch), read what it wrote, and record
each test's measured numbers under $GPU_REPORT_DIR for scripts/gpu_report.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from hftrain.checkpoint.layout import RunLayout

from ..support.cli import ROOT

REPORT_ENV = "GPU_REPORT_DIR"


def record(item: str, name: str, numbers: dict[str, Any]) -> None:
    """Write one test's numbers as $GPU_REPORT_DIR/NAME.json, tagged with its acceptance item."""
    directory = os.environ.get(REPORT_ENV)
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / f"{name}.json").write_text(
        json.dumps({"item": item, "test": name, "numbers": numbers}, indent=2, default=str)
    )


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    return result


def hftrain(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hftrain", *args], timeout)


def accelerate(config: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """accelerate launch with a shipped config on NPROC GPUs; ARGS is a script and its arguments, or -m MODULE ..."""
    return run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--num_processes",
            str(nproc),
            *args,
        ],
        timeout,
    )


def write_recipe(raw: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def shipped_recipe(name: str, output_dir: Path, **training: Any) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "recipes" / name).read_text(encoding="utf-8"))
    raw["training"].update(output_dir=str(output_dir), report_to="none", disable_tqdm=True, **training)
    raw.setdefault("monitor", {}).update(sample_max_new_tokens=0, plot=False)
    return raw


def results(out: Path) -> dict[str, Any]:
    return json.loads(RunLayout(out).results.read_text())


def logged(out: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in RunLayout(out).metrics.read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def flops_per_token(out: Path, seq_len: int) -> float:
    from transformers import AutoConfig

    from hftrain.model.shape import flops_per_token as per_token

    return per_token(results(out)["parameters"], AutoConfig.from_pretrained(RunLayout(out).final), seq_len)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()
