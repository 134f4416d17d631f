"""`hftrain report RUN_DIR`: one self-contained HTML page that sums up a run.

A run leaves its story in several files (metrics.jsonl, results.json, eval*.json, the resolved recipe).
The report puts them on one page that can be mailed, attached to an issue or archived next to the weights:
the charts are matplotlib PNGs embedded as base64 data URIs and the styling is inline, so the file needs no
network, no JavaScript and no other file to display the same everywhere.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from hftrain.checkpoint.files import read_json, write_new_file
from hftrain.checkpoint.layout import RECIPE_FILE, RunLayout, checkpoint_step
from hftrain.errors import HftrainError

MAX_EVAL_ROWS = 200

# (id, title, metrics key(s), y label, colour); each chart also draws the evaluations' eval_<key> where logged.
CHARTS = [
    ("chart-loss", "Loss", "loss", "loss (nats/token)", "tab:blue"),
    (
        "chart-reward-margin",
        "DPO reward margin (chosen - rejected)",
        "rewards/margins",
        "reward margin (nats)",
        "tab:olive",
    ),
    ("chart-reward-accuracy", "DPO reward accuracy", "rewards/accuracies", "share of pairs", "tab:cyan"),
    ("chart-grad-norm", "Gradient norm", "grad_norm", "gradient norm", "tab:orange"),
    ("chart-learning-rate", "Learning rate", "learning_rate", "learning rate", "tab:purple"),
    ("chart-tokens-per-s", "Throughput", "tokens_per_s", "tokens/s", "tab:red"),
    ("chart-data-wait", "Data-wait fraction", "data_wait_frac", "fraction of step time", "tab:brown"),
]

CSS = """
body {
  font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
  margin: 24px auto;
  max-width: 1160px;
  color: #222;
}
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: 4px;}
.path { color: #666; font-family: monospace; }
table { border-collapse: collapse; margin: 8px 0 16px;}
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: left;}
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.charts figure { margin: 0; border: 1px solid #e3e3e3; padding: 4px;}
.charts img { width: 100%; height: auto; display: block;}
.note { color: #8a5a00;}
pre { background: #f6f6f6; border: 1px solid #ddd; padding: 10px; overflow-x: auto; font-size: 0.85em;}
blockquote {
  background: #f6f8ff;
  border-left: 4px solid #5b7db1;
  margin: 8px 0;
  padding: 8px 12px;
  white-space: pre-wrap;
}
"""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The log lines of metrics.jsonl (a torn last line, e.g. after a kill, is skipped)."""
    path = RunLayout(run_dir).metrics
    if not path.is_file():
        raise HftrainError(f"{run_dir} is not a run directory: no metrics.jsonl; give the training.output_dir of a run")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; when a resumed run logged a step twice, the later line wins."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(record["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def chart_png(records: list[dict[str, Any]], key: str, title: str, ylabel: str, colour: str) -> bytes | None:
    """One metric against step as PNG bytes, or None when the metrics do not have it."""
    steps, values = series(records, key)
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.2), dpi=100)
    ax.plot(steps, values, color=colour, linewidth=1.8, label=f"train {key}")
    eval_steps, eval_values = series(records, f"eval_{key}")
    if eval_steps:
        ax.plot(eval_steps, eval_values, "o-", color="tab:green", label=f"eval {key}")
    if eval_steps or key == "loss":
        ax.legend()
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if key == "learning_rate":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _table(rows: list[tuple[str, Any]], header: tuple[str, str] = ("", "")) -> str:
    head = f"<tr><th>{html.escape(header[0])}</th><th>{html.escape(header[1])}</th></tr>" if any(header) else ""
    body = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td "
        f'class="{"num" if isinstance(v, (int, float)) else ""}">{html.escape(_fmt(v))}</td></tr>'
        for k, v in rows
    )
    return f"<table>{head}{body}</table>"


def summary_rows(results: dict[str, Any], records: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for label, key in [
        ("final step", "step"),
        ("final eval loss", "eval_loss"),
        ("eval perplexity", "eval_perplexity"),
        ("median tokens/s", "tokens_per_s_median"),
    ]:
        if results.get(key) is not None:
            rows.append((label, results[key]))
    if results.get("mfu_median") is not None:
        rows.append(("median MFU (%)", round(100 * results["mfu_median"], 2)))
    params = results.get("parameters")
    if isinstance(params, dict):
        rows += [(f"parameters ({name.replace('_', '-')})", count) for name, count in params.items()]
    elif params is not None:
        rows.append(("parameters", params))
    for label, key in [
        ("eval bits per byte", "eval_bits_per_byte"),
        ("peak memory (GB)", "peak_mem_gb"),
        ("time to first step (s)", "time_to_first_step_s"),
        ("bf16", "bf16"),
        ("torch.compile", "torch_compile"),
    ]:
        if results.get(key) is not None:
            rows.append((label, results[key]))
    speed = results.get("speed")
    if isinstance(speed, dict) and speed.get("reasons"):
        rows.append(("speed choices", "; ".join(speed["reasons"])))
        for dtype, seconds in (speed.get("measured") or {}).get("step_seconds", {}).items():
            rows.append((f"estimated s/step ({dtype})", round(seconds, 4)))
    for phase in ("data_wait", "forward", "backward", "optimizer"):  # where the step time went
        if results.get(f"{phase}_frac") is not None:
            rows.append((f"step time: {phase.replace('_', ' ')} (%)", round(100 * results[f"{phase}_frac"], 1)))
    if results.get("input_bound") is not None:
        rows.append(
            (
                "input-bound",
                "yes: more data workers, a token folder (hftrain data prepare) or closer data"
                if results["input_bound"]
                else "no",
            )
        )
    for label, key in [
        ("distributed type", "distributed_type"),
        ("world size", "world_size"),
        ("data records skipped", "data_records_skipped"),
    ]:
        if results.get(key) is not None:
            rows.append((label, results[key]))
    seen = series(records, "tokens_seen")[1]
    if seen:
        rows.append(("tokens seen", int(seen[-1])))
    return rows


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys; lists and scalars stay values."""
    if isinstance(value, dict) and value:
        return [row for k, v in value.items() for row in flatten(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix or "(value)", value)]


def eval_sections(run_dir: Path) -> str:
    parts = []
    for path in sorted(run_dir.glob("eval*.json")):
        try:
            rows = flatten(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            parts.append(
                f'<h3>{html.escape(path.name)}</h3><p class="note">not readable as JSON: {html.escape(str(err))}</p>'
            )
            continue
        more = (
            f'<p class="note">... {len(rows) - MAX_EVAL_ROWS} more keys not shown</p>'
            if len(rows) > MAX_EVAL_ROWS
            else ""
        )
        parts.append(f"<h3>{html.escape(path.name)}</h3>{_table(rows[:MAX_EVAL_ROWS], ('key', 'value'))}{more}")
    return "".join(parts) or (
        "<p>No <code>eval*.json</code> files in the run directory (<code>hftrain eval ... --json "
        "RUN_DIR/eval_NAME.json</code> writes one).</p>"
    )


def find_recipe(run_dir: Path) -> Path | None:
    """final/hftrain_recipe.yaml, else the newest checkpoint's."""
    final = RunLayout(run_dir).final_recipe()
    if final.is_file():
        return final
    found = [
        (step, p)
        for p in run_dir.glob(f"checkpoint-*/{RECIPE_FILE}")
        if (step := checkpoint_step(p.parent)) is not None
    ]
    return max(found)[1] if found else None


def stale_results(results: dict[str, Any], records: list[dict[str, Any]]) -> str | None:
    """Why results.json is not the run's final word, when metrics.jsonl went on past it (a run still training,
    or continued after it finished once); None when it is."""
    done, last = results.get("step"), max((r["step"] for r in records if isinstance(r.get("step"), int)), default=None)
    if not results or not isinstance(done, int) or last is None or last <= done:
        return None
    return (
        f"results.json is from step {done:,}, and metrics.jsonl goes on to step {last:,}: the run is still training "
        "or was continued, so the summary below is an earlier finish's, not this run's final results."
    )


def run_staleness(run_dir: Path) -> str | None:
    """stale_results for a run directory (what `hftrain report` also prints)."""
    path = RunLayout(run_dir).results
    return stale_results(read_json(path, "the run's results") if path.is_file() else {}, read_metrics(run_dir))


def write_report(run_dir: Path, out: Path | None = None, replace: bool = False) -> Path:
    """Write run_dir/report.html (hftrain's own: written anew each time), or `out`: a new file, or with `replace`
    in place of a regular file (checkpoint/files.py's write_new_file); return its path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    results_path = RunLayout(run_dir).results
    results = read_json(results_path, "the run's results") if results_path.is_file() else {}

    figures, missing = [], []
    for chart_id, title, key, ylabel, colour in CHARTS:
        png = chart_png(records, key, title, ylabel, colour)
        if png is None:
            missing.append(f"{title}: no <code>{key}</code> values in metrics.jsonl")
            continue
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        alt = f"{title} against optimizer step" + (" (train and eval)" if key == "loss" else "")
        figures.append(f'<figure><img id="{chart_id}" alt="{html.escape(alt)}" src="{uri}"></figure>')
    skipped = "".join(f"<li>{m}</li>" for m in missing)

    stale = stale_results(results, records)
    if results:
        summary = (f'<p class="note" id="stale">{html.escape(stale)}</p>' if stale else "") + _table(
            summary_rows(results, records)
        )
    else:
        summary = '<p class="note">No results.json: the run has not finished (the charts show it so far).</p>'
    samples = results.get("sample")
    samples = [samples] if isinstance(samples, str) else list(samples or [])
    sample_html = (
        "".join(f"<blockquote>{html.escape(str(s))}</blockquote>" for s in samples)
        or "<p>No sample in results.json.</p>"
    )
    recipe_path = find_recipe(run_dir)
    if recipe_path is not None:
        recipe_html = (
            f'<p class="path">{html.escape(str(recipe_path.relative_to(run_dir)))}</p>'
            f'<pre id="recipe">{html.escape(recipe_path.read_text(encoding="utf-8"))}</pre>'
        )
    else:
        recipe_html = '<p class="note">No hftrain_recipe.yaml in final/ or any checkpoint-N/.</p>'

    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>hftrain report: {html.escape(run_dir.name)}</title>
<style>{CSS}</style></head><body>
<h1>hftrain report</h1><p class="path">{html.escape(str(run_dir.resolve()))}</p>
<h2>Summary</h2>{summary}
<h2>Training curves</h2><div class="charts">{"".join(figures)}</div>
{f'<p class="note">Charts not drawn:</p><ul class="note">{skipped}</ul>' if skipped else ""}
<h2>Evaluations</h2>{eval_sections(run_dir)}
<h2>Sample</h2>{sample_html}
<h2>Resolved recipe</h2>{recipe_html}
</body></html>
"""
    if out is None:  # the run's own report, written anew
        return write_new_file(RunLayout(run_dir).report, page, "report", replace=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return write_new_file(Path(out), page, "--out", replace=replace)
