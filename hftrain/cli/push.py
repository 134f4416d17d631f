"""`hftrain push PATH --repo-id NS/NAME | --to s3://... | --report-to TRACKERS`: share a run's final model or a
model directory, or send a run's metrics to trackers that were down while it trained."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TAKES_OVERRIDES = False


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("push", help="share a run's final model (or a model directory) on the hub or in S3")
    p.add_argument("path", help="a run directory (training.output_dir) or a model directory")
    p.add_argument(
        "--repo-id", help="NAMESPACE/NAME on the hub (HF_ENDPOINT for a self-hosted server; token from HF_TOKEN)"
    )
    p.add_argument("--revision", type=branch_name, help="branch to push to (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--to", help="an s3:// (or other fsspec) URL instead of the hub")
    p.add_argument(
        "--report-to",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        help=(
            "send the run's metrics.jsonl to these trackers "
            "(comma-separated report_to names: mlflow, wandb, trackio, ...)"
        ),
    )
    return p


def branch_name(text: str) -> str:
    """--revision checked by git's rules for a branch name (git check-ref-format) before anything is sent: the Hub
    answers a bad one with a 400 only after the model is bundled."""
    import re

    bad = re.search(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//", text)
    parts = text.split("/")
    if (
        not text
        or bad
        or text == "@"
        or text.startswith(("-", "/"))
        or text.endswith(("/", "."))
        or any(p.startswith(".") or p.endswith(".lock") for p in parts)
    ):
        why = f"it contains {bad.group()!r}" if bad else "see git check-ref-format"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a branch name ({why}); use letters, digits, "
            "'-', '_', '.' and '/' (no '..', no part starting with '.')"
        )
    return text


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.integrations.publish import push_run

    if args.report_to:
        from hftrain.integrations.trackers import report_run

        sent = report_run(Path(args.path), args.report_to)
        print(f"reported: {sent} records of {Path(args.path) / 'metrics.jsonl'} to {', '.join(args.report_to)}")
        if not (args.repo_id or args.to):
            return 0
    target = push_run(
        Path(args.path), repo_id=args.repo_id, to=args.to, private=args.private or None, revision=args.revision
    )
    print(f"pushed: {target}")
    return 0
