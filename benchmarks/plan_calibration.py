"""`hftrain plan`'s predicted peak memory per process against the measured peak of real 3-step runs.

    python benchmarks/plan_calibration.py [--only NAME,...] [--json FILE]

Each configuration is a real `hftrain train` (3 steps, then the final evaluation and save) in a fresh process,
watched from outside: the RSS high-water mark (VmHWM) of every process of the run, read every 20 ms; for 2
processes, the largest training process. The prediction is `hftrain.planning.memory.predict_peak` for the same recipe,
computed on paper. "above libs" subtracts the libraries' own footprint (a process that imported them and did
nothing), so that a good total cannot hide a wrong model part. Models are presets with random weights and the
built-in GPT-2 tokenizer (50,304-row embeddings, as Pythia), saved once for the fine-tuning rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Config:
    name: str
    size: str  # a preset
    method: str = "pretrain"  # pretrain (full, from scratch) | full | lora | qlora (fine-tuning a saved base)
    batch: int = 4
    seq_len: int = 256
    checkpointing: bool = False
    processes: int = 1  # 2: an FSDP rehearsal (gloo)
    objective: str = "lm"  # lm | dpo (the shipped preference pairs; full keeps a reference copy)
    extra: dict[str, Any] = field(default_factory=dict)


GRID = [
    Config("31m-b4-s256", "pythia-31m"),
    Config("31m-b8-s512", "pythia-31m", batch=8, seq_len=512),
    Config("31m-b8-s512-gc", "pythia-31m", batch=8, seq_len=512, checkpointing=True),
    Config("31m-eager-b4-s512", "pythia-31m", seq_len=512, extra={"model.attn_implementation": "eager"}),
    Config("31m-lora-b8-s256", "pythia-31m", "lora", batch=8),
    Config("31m-qlora-b8-s256-gc", "pythia-31m", "qlora", batch=8, checkpointing=True),
    Config("31m-fsdp2-b4-s256", "pythia-31m", processes=2),
    Config("31m-dpo-full-b4-s256", "pythia-31m", "full", objective="dpo"),
    Config("31m-dpo-lora-b8-s256", "pythia-31m", "lora", batch=8, objective="dpo"),
    Config("160m-b4-s256", "pythia-160m"),
    Config("160m-b2-s1024", "pythia-160m", batch=2, seq_len=1024),
    Config("160m-b2-s1024-gc", "pythia-160m", batch=2, seq_len=1024, checkpointing=True),
    Config("160m-full-b4-s256", "pythia-160m", "full"),
    Config("160m-lora-b4-s256", "pythia-160m", "lora"),
    Config("160m-qlora-b4-s256", "pythia-160m", "qlora"),
    Config("160m-fsdp2-b2-s256", "pythia-160m", batch=2, processes=2),
]


def recipe_for(config: Config, bases: Path, out: Path) -> dict[str, Any]:
    """The run's recipe: 3 steps, a final evaluation of 8 blocks, no sample, no plot."""
    if config.method == "pretrain":
        model = {"preset": config.size}
        tokenizer: dict[str, Any] = {"builtin": "gpt2"}
        # 8 full blocks at 1,024 tokens
        data: dict[str, Any] = {"train": {"builtin": "python-docs"}, "holdout_every": 10}
    else:
        model = {"from_pretrained": str(bases / config.size)}
        tokenizer = {"path": str(bases / config.size)}
        kind, fmt = ("preference", "preference") if config.objective == "dpo" else ("", "prompt_completion")
        data = {
            "train": {
                "path": str(ROOT / f"recipes/finetune/data/{kind + '_' if kind else ''}train.jsonl"),
                "format": fmt,
            },
            "validation": {
                "path": str(ROOT / f"recipes/finetune/data/{kind + '_' if kind else ''}validation.jsonl"),
                "format": fmt,
            },
        }
    recipe: dict[str, Any] = {
        "model": model,
        "tokenizer": tokenizer,
        "data": {**data, "seq_len": config.seq_len, "eval_blocks": 8},
        "training": {
            "output_dir": str(out),
            "max_steps": 3,
            "per_device_train_batch_size": config.batch,
            "gradient_checkpointing": config.checkpointing,
            "logging_steps": 1,
            "save_steps": 1000,
            "report_to": "none",
            "disable_tqdm": True,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }
    if config.method != "pretrain":
        recipe["finetune"] = {
            "method": config.method,
            "lora": {"r": 16, "lora_alpha": 32},
            "objective": config.objective,
        }
    for key, value in config.extra.items():
        section, name = key.split(".", 1)
        recipe.setdefault(section, {})[name] = value
    return recipe


def hwm_bytes(pid: int) -> int | None:
    """A process's RSS high-water mark (VmHWM; it covers the whole process since exec, so no peak is missed)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def largest_peak(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> tuple[int, int, str]:
    """Run `cmd`; return (exit code, the largest VmHWM among its processes, the output's tail)."""
    import psutil

    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        root, peaks = psutil.Process(proc.pid), {}
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                peaks[p.pid] = max(peaks.get(p.pid, 0), hwm_bytes(p.pid) or 0)
            if time.monotonic() - started > timeout:
                proc.kill()
            time.sleep(0.02)
        log.seek(0)
        return proc.returncode, max(peaks.values(), default=0), log.read()[-3000:]


def library_peak(env: dict[str, str]) -> int:
    """The footprint of the libraries alone, as `hftrain train` imports them, measured the way the runs are."""
    code = "from hftrain.planning.memory import import_training_libraries as f; f()"
    rc, peak, tail = largest_peak([sys.executable, "-c", code], env)
    if rc:
        sys.exit(f"measuring the libraries' footprint failed:\n{tail}")
    return peak


def predicted_libraries(env: dict[str, str]) -> float:
    """The libraries' figure `hftrain plan` uses (memory.library_footprint, measured in a fresh process, cached)."""
    code = "from hftrain.planning.memory import library_footprint; print('BYTES', library_footprint(measure=True))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("BYTES ")), None)
    if done.returncode or line is None:
        sys.exit(f"the libraries' footprint failed:\n{done.stderr[-3000:]}")
    return float(line.split()[1])


def build_bases(root: Path, sizes: set[str]) -> None:
    """Random-weight presets saved as pretrained models with the GPT-2 tokenizer, for the fine-tuning rows."""
    from hftrain.model.build import build_model
    from hftrain.model.part import ModelPart
    from hftrain.model.tokenizer import gpt2_tokenizer
    from hftrain.recipe.load import load_recipe

    tok = gpt2_tokenizer()
    for size in sorted(sizes):
        if not (root / size / "config.json").is_file():
            model = build_model(ModelPart.of(load_recipe(None, {"model": {"preset": size}})), tok, False)
            model.save_pretrained(root / size)
            tok.save_pretrained(root / size)


def measure(
    config: Config, bases: Path, work: Path, env: dict[str, str], libraries: float | None = None
) -> dict[str, Any]:
    """Run one configuration for real; return its measured and predicted peaks (bytes)."""
    import yaml

    from hftrain.planning.estimates import plan
    from hftrain.planning.memory import predict_peak, run_shape
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    raw = recipe_for(config, bases, work / config.name)
    path = work / f"{config.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "hftrain", "train", str(path)]
    if config.processes > 1:
        cmd += ["--accelerate-config", "fsdp", "--cpu", "--nproc", str(config.processes)]
    started = time.monotonic()
    rc, peak, tail = largest_peak(cmd, env)
    if rc:
        raise RuntimeError(f"{config.name} failed (exit {rc}):\n{tail}")
    recipe = load_recipe(None, raw)
    shape = run_shape(
        PlanPart.of(recipe), processes=config.processes, strategy="fsdp" if config.processes > 1 else None
    )
    predicted = predict_peak(PlanPart.of(recipe), plan(PlanPart.of(recipe)), shape, libraries)
    return {
        "name": config.name,
        "measured": peak,
        "predicted": predicted.total,
        "libraries": predicted.parts["libraries"],
        "parts": predicted.parts,
        "phase": predicted.phase,
        "seconds": round(time.monotonic() - started, 1),
    }


def print_table(rows: list[dict[str, Any]], libs_measured: int) -> None:
    print(f"libraries alone: {libs_measured / 1e9:.3f} GB measured (this machine, these versions)")
    print(
        f"{'configuration':<24} {'measured':>9} {'predicted':>9} "
        f"{'error':>7} {'above libs: meas':>17} {'pred':>7} {'error':>7}"
    )
    worst = 0.0
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        above_m, above_p = r["measured"] - libs_measured, r["predicted"] - r["libraries"]
        err_above = above_p / above_m - 1
        worst = max(worst, abs(err), abs(err_above))
        print(
            f"{r['name']:<24} {r['measured'] / 1e9:>6.3f} GB {r['predicted'] / 1e9:>6.3f} GB {err:>+7.1%} "
            f"{above_m / 1e9:>14.3f} GB {above_p / 1e9:>7.3f} {err_above:>+7.1%}"
        )
    print(f"worst relative error: {worst:.1%} over {len(rows)} configurations")


def replay(path: Path) -> None:
    """The stored measurements against the current prediction (the same recipes, the stored libraries figure)."""
    from hftrain.planning.estimates import plan
    from hftrain.planning.memory import predict_peak, run_shape
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    stored = json.loads(path.read_text())
    by_name = {c.name: c for c in GRID}
    with tempfile.TemporaryDirectory(prefix="hftrain-plancal-") as tmp:
        bases = Path(tmp) / "bases"
        build_bases(bases, {by_name[r["name"]].size for r in stored["rows"] if by_name[r["name"]].method != "pretrain"})
        for r in stored["rows"]:
            config = by_name[r["name"]]
            recipe = load_recipe(None, recipe_for(config, bases, Path(tmp) / config.name))
            shape = run_shape(
                PlanPart.of(recipe), processes=config.processes, strategy="fsdp" if config.processes > 1 else None
            )
            predicted = predict_peak(PlanPart.of(recipe), plan(PlanPart.of(recipe)), shape, r["libraries"])
            r.update(predicted=predicted.total, parts=predicted.parts, phase=predicted.phase)
    print_table(stored["rows"], stored["libraries"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--replay",
        type=Path,
        help=(
            "predict again for the measurements stored by --json (after a change of the model in "
            "hftrain/planning/memory.py); runs nothing"
        ),
    )
    args = parser.parse_args()
    if args.replay:
        return replay(args.replay)
    grid = [c for c in GRID if not args.only or c.name in args.only.split(",")]
    env = {**os.environ, "HFTRAIN_CACHE_DIR": os.environ.get("HFTRAIN_CACHE_DIR", str(Path.home() / ".cache/hftrain"))}
    with tempfile.TemporaryDirectory(prefix="hftrain-plancal-") as tmp:
        work = Path(tmp)
        build_bases(work / "bases", {c.size for c in grid if c.method != "pretrain"})
        libs, predicted_libs = library_peak(env), predicted_libraries(env)
        rows = []
        for config in grid:
            rows.append(measure(config, work / "bases", work, env, predicted_libs))
            r = rows[-1]
            print(
                f"  {config.name}: measured {r['measured'] / 1e9:.3f} GB, predicted {r['predicted'] / 1e9:.3f} GB "
                f"({r['seconds']:.0f} s)",
                flush=True,
            )
        print_table(rows, libs)
        if args.json:
            args.json.write_text(json.dumps({"libraries": libs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
