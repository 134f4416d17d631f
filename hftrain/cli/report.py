"""`hftrain report RUN_DIR`: one self-contained HTML page of a run (charts, results, sample, recipe)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TAKES_OVERRIDES = False  # a run directory may contain "="


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report of a run (charts, results, sample, recipe)",
        description="Write RUN_DIR/report.html: one HTML file with no external resources.",
    )
    p.add_argument("run_dir", help="a run's training.output_dir (holds metrics.jsonl)")
    p.add_argument("--out", metavar="FILE", help="write here, as a new file, instead of RUN_DIR/report.html")
    p.add_argument("--force", action="store_true", help="with --out: replace a file that exists there")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.eval.report import run_staleness, write_report

    path = write_report(Path(args.run_dir), Path(args.out) if args.out else None, replace=args.force)
    stale = run_staleness(Path(args.run_dir))
    if stale:
        print(f"hftrain: note: {stale}")
    print(f"report: {path}")
    return 0
