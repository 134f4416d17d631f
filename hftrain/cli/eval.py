"""`hftrain eval MODEL_DIR`: perplexity, bits per byte, last-word accuracy or lm-eval tasks of a model
(the measuring itself is text_metrics.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hftrain.cli.numbers import positive_int
from hftrain.errors import HftrainError
from hftrain.eval import METRICS

TAKES_OVERRIDES = False  # a `key=value` word (e.g. s3://b/year=2024/x.jsonl) is a value here


def format_results(results: dict[str, dict[str, Any]]) -> str:
    """An aligned table of the numeric values of {name: {measure: value}}."""
    rows = [("name", "measure", "value")]
    for name, values in results.items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                text = (
                    f"{value:,}" if isinstance(value, int) else f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4e}"
                )
                rows.append((name, key, text))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="perplexity, bits per byte, last-word accuracy or lm-eval tasks of a model",
        description="Evaluate MODEL_DIR on --data with --metric, or on lm-eval tasks with --lm-eval.",
    )
    p.add_argument("model_dir", help="a standard Hugging Face model directory (a run's final/ or checkpoint-N)")
    p.add_argument(
        "--data",
        metavar="PATH_OR_URL",
        help=".jsonl/.jsonl.gz/.txt file, directory or glob, local or s3://...; or hf:NAME[:CONFIG[:SPLIT]]",
    )
    p.add_argument("--metric", action="append", choices=METRICS, help="repeat for several (default: perplexity)")
    p.add_argument("--text-field", default="text", help="the JSONL key / dataset column holding the text")
    p.add_argument(
        "--context", type=positive_int, help="tokens per window (default: max_position_embeddings, at most 1024)"
    )
    p.add_argument("--stride", type=positive_int, help="tokens a window advances (default: context // 2)")
    p.add_argument("--limit", type=positive_int, help="first N documents of --data, or N examples per lm-eval task")
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON, in a new file")
    p.add_argument("--force", action="store_true", help="with --json: replace a file that exists there")
    p.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-eval tasks (shipped: local_lambada)")
    p.add_argument("--include-path", metavar="DIR", help="a directory of extra lm-eval task YAMLs")
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """`hftrain eval`: print the results table, and write JSON with --json."""
    from hftrain.eval.text_metrics import evaluate_texts, load_model, load_texts, run_lm_eval

    if bool(args.data) == bool(args.lm_eval):
        raise HftrainError("eval: give either --data PATH_OR_URL (with --metric) or --lm-eval TASKS")
    if args.lm_eval:
        if args.metric or args.context is not None or args.stride is not None:
            raise HftrainError("eval: --metric, --context and --stride go with --data, not --lm-eval")
        tasks = [task.strip() for task in args.lm_eval.split(",") if task.strip()]
        output = run_lm_eval(args.model_dir, tasks, args.include_path, args.limit)
        table, payload = output.get("results", {}), {"model_dir": str(args.model_dir), "lm_eval": output}
    else:
        model, tokenizer = load_model(args.model_dir)
        texts = load_texts(args.data, args.text_field, args.limit)
        table = evaluate_texts(model, tokenizer, texts, args.metric or ["perplexity"], args.context, args.stride)
        payload = {"model_dir": str(args.model_dir), "data": args.data, "results": table}
    print(format_results(table))
    if args.json:  # a new file, or with --force in place of a regular one
        from hftrain.checkpoint.files import write_new_file

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_new_file(Path(args.json), json.dumps(payload, indent=2, default=str) + "\n", "--json", replace=args.force)
        print(f"wrote {args.json}")
    return 0
