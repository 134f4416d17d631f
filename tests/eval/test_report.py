"""`hftrain report`: one self-contained HTML page per run, checked as text and as rendered by headless Chromium."""

from __future__ import annotations

import argparse
import base64
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hftrain.checkpoint.layout import RunLayout
from hftrain.cli.report import add_parser, run
from hftrain.errors import HftrainError
from hftrain.eval.report import write_report

from ..support.checks import read_metrics

CHART_IDS = ["chart-loss", "chart-grad-norm", "chart-learning-rate", "chart-tokens-per-s"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib's tab: colours of the four charts' lines (loss, grad norm, learning rate, tokens/s).
LINE_COLOURS = {
    "tab:blue": (31, 119, 180),
    "tab:orange": (255, 127, 14),
    "tab:purple": (148, 103, 189),
    "tab:red": (214, 39, 40),
}


def img_tags(page: str) -> dict[str, str]:
    """id -> the whole <img ...> tag."""
    tags = {}
    for tag in re.findall(r"<img\b[^>]*>", page):
        found = re.search(r'\bid="([^"]+)"', tag)
        assert found, f"an <img> without id: {tag[:120]}"
        tags[found.group(1)] = tag
    return tags


def png_of(tag: str) -> bytes:
    src = re.search(r'\bsrc="data:image/png;base64,([A-Za-z0-9+/=]+)"', tag)
    assert src, f"not an inline PNG: {tag[:120]}"
    return base64.b64decode(src.group(1), validate=True)


@pytest.fixture(scope="module")
def report(pretrained_run) -> Path:
    return write_report(pretrained_run.output_dir)


def test_report_is_self_contained_with_charts_sample_and_recipe(report: Path, pretrained_run) -> None:
    run_dir = Path(pretrained_run.output_dir)
    assert report == RunLayout(run_dir).report
    page = report.read_text(encoding="utf-8")
    assert "<script" not in page.lower() and "@import" not in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I), (
        "a reference to an external resource"
    )
    assert not re.search(r"url\(\s*['\"]?(?:https?:)?//", page, re.I), "CSS loading an external resource"

    tags = img_tags(page)
    assert set(CHART_IDS) <= set(tags), tags.keys()
    for chart_id in CHART_IDS:
        assert re.search(r'\balt="[^"]+"', tags[chart_id]), f"{chart_id} has no alt text"
        png = png_of(tags[chart_id])
        assert png.startswith(PNG_SIGNATURE) and len(png) > 5000, (chart_id, len(png))
    # Training logs the data-wait fraction: its chart is there too.
    assert "chart-data-wait" in tags and png_of(tags["chart-data-wait"]).startswith(PNG_SIGNATURE)

    results = json.loads(RunLayout(run_dir).results.read_text(encoding="utf-8"))
    assert results["sample"] and html.escape(results["sample"]) in page
    recipe = RunLayout(run_dir).final_recipe().read_text(encoding="utf-8")
    assert f'<pre id="recipe">{html.escape(recipe)}</pre>' in page
    assert f"{results['eval_loss']:,.4g}" in page and "world size" in page
    assert "step time: forward (%)" in page and "input-bound" in page and "eval bits per byte" in page


def test_report_escapes_text_and_shows_evals_and_data_wait(pretrained_run, tmp_path: Path) -> None:
    src = Path(pretrained_run.output_dir)
    run_dir = tmp_path / "run"
    RunLayout(run_dir).final.mkdir(parents=True)
    evil = '<script>alert("x")</script> & <b>'
    lines = read_metrics(src)
    lines = [{**rec, "data_wait_frac": 0.1 + 0.01 * rec["step"]} if "loss" in rec else rec for rec in lines]
    RunLayout(run_dir).metrics.write_text(
        "".join(json.dumps(rec) + "\n" for rec in lines) + '{"step": 9', encoding="utf-8"
    )
    results = json.loads(RunLayout(src).results.read_text(encoding="utf-8"))
    RunLayout(run_dir).results.write_text(json.dumps({**results, "sample": evil}), encoding="utf-8")
    recipe = RunLayout(src).final_recipe().read_text(encoding="utf-8") + f"# {evil}\n"
    RunLayout(run_dir).final_recipe().write_text(recipe, encoding="utf-8")
    (run_dir / "eval_heldout.json").write_text(
        json.dumps({"model_dir": "final", "results": {"perplexity": 12.5, "bits_per_byte": 1.25}})
    )

    out = tmp_path / "elsewhere" / "r.html"
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert run(parser.parse_args(["report", str(run_dir), "--out", str(out)]), []) == 0
    page = out.read_text(encoding="utf-8")
    assert "<script" not in page.lower() and "<b>" not in page
    assert page.count(html.escape(evil)) == 2  # the sample and the recipe
    assert "chart-data-wait" in img_tags(page) and "data_wait_frac values" not in page
    assert "eval_heldout.json" in page and "results.perplexity" in page and "12.5" in page


def test_report_refuses_a_directory_without_metrics(tmp_path: Path) -> None:
    with pytest.raises(HftrainError, match=r"is not a run directory: no metrics.jsonl; give the training.output_dir"):
        write_report(tmp_path)


def test_report_of_a_run_that_went_on_says_its_results_are_not_final(pretrained_run, tmp_path: Path, capsys) -> None:
    """A run continued (or still training) after results.json was written: the page and the command say so."""
    run_dir = tmp_path / "run"
    shutil.copytree(pretrained_run.output_dir, run_dir, ignore=shutil.ignore_patterns("checkpoint-*", "final"))
    done = json.loads(RunLayout(run_dir).results.read_text())["step"]
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    fresh = write_report(run_dir, tmp_path / "fresh.html").read_text()
    assert 'id="stale"' not in fresh  # the check can fail: a finished run's page has no such note
    with RunLayout(run_dir).metrics.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": done + 5, "loss": 1.0, "learning_rate": 1e-4, "grad_norm": 0.5}) + "\n")
    assert run(add_parser(argparse.ArgumentParser().add_subparsers()).parse_args([str(run_dir)]), []) == 0
    expected = (
        f"results.json is from step {done:,}, and metrics.jsonl goes on to step {done + 5:,}: the run is still training"
    )
    assert expected in capsys.readouterr().out
    assert expected in html.unescape((run_dir / "report.html").read_text())
    assert all(
        (run_dir / name).read_bytes() == data
        for name, data in before.items()
        if name not in ("metrics.jsonl", "report.html")
    )


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed; the report render test needs it: apt-get install -y chromium")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(profile),
        "XDG_CONFIG_HOME": str(profile),
        "XDG_CACHE_HOME": str(profile),
    }
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(report: Path, tmp_path: Path) -> None:
    from PIL import Image

    url = report.resolve().as_uri()
    shot = tmp_path / "report.png"
    done = _chromium(f"--screenshot={shot}", "--window-size=1200,2400", url, profile=tmp_path / "profile")
    assert shot.is_file() and shot.stat().st_size > 50_000, done.stderr[-2000:]

    dom = _chromium("--dump-dom", url, profile=tmp_path / "profile2").stdout
    rendered = img_tags(dom)
    for chart_id in CHART_IDS:
        assert chart_id in rendered and png_of(rendered[chart_id]).startswith(PNG_SIGNATURE), chart_id

    # The charts really decoded: the screenshot holds many colours (text alone gives ~600), and each chart's line
    # colour (the page's CSS uses none of them).
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2400)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 1500, f"{len(colours or [])} distinct colours: a blank page?"
    for name, rgb in LINE_COLOURS.items():
        near = sum(n for n, c in colours if max(abs(a - b) for a, b in zip(c, rgb)) <= 12)
        assert near > 200, f"{name} line not visible in the rendered page ({near} pixels)"
