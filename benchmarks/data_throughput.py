"""Data pipeline throughput vs training consumption, side by side in one run.

    python benchmarks/data_throughput.py [--repeats 3]

Measures tokens/s of hftrain's data paths (streaming tokenize + pack from local .jsonl.gz shards, the same from
a local S3 endpoint (moto's server, needs the test extra), and pre-tokenized shards) with the default loader
settings, and the training tokens/s of a 6-layer / 384-hidden / context-256 NeoX at batch 8 on the same machine.
Medians over the repeats; the machine is shared, so read the ratios. The goal: data >= 20x training.
Ends with one line per path:  PATH: data X tok/s, training Y tok/s, ratio Z

Then `hftrain data prepare` (datatrove: one task per input file) on a generated corpus of --prepare-mb (default 100)
MB of plain JSONL in 8 files, against the process pool it replaced (hftrain at --baseline-rev, run from a git worktree
of that revision), each as a command (start-up included on both sides), on 1 and on 2 workers, taken in turn:
    prepare W workers: datatrove X tok/s (x per core), pool Y tok/s (y per core), ratio Z

First, the input beside a GPU (issue 51 part 5): tokens/s per DataLoader worker count (--workers; default 0, 1, 2,
4, ... up to the cores) from raw text (the built-in corpus as .jsonl.gz shards, tokenized as it is read) and from
a token folder (`hftrain data prepare`), at --recipe's seq_len without a shuffle window, beside the tokens/s one GPU
consumes for that recipe as `hftrain plan --gpus N --gpu-mem-gb M --gpu-type T` times its step (at --mfu, default
hftrain plan's). Per row: the median rate, per worker, its ratio to the GPU's consumption, and the share of each
step the GPU would wait for data (hftrain/data/input_rate.py: what `train` warns about before step 1):
    workers W: raw text X tok/s (Y per worker, Zx the GPU, wait S%) | shards ...

    python benchmarks/data_throughput.py --sections workers --gpus 1 --gpu-type H200 \
        --recipe recipes/pretrain/pythia-160m.yaml
    python benchmarks/data_throughput.py --dry-run     # seconds: the workers section at a tiny size, 0 and 1 workers
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hftrain
from hftrain.data.builtin_corpus import module_docstrings, python_docs_files
from hftrain.data.loader import PackedDataset, ResumableLoader, plan_data
from hftrain.data.part import DataPart
from hftrain.data.prepare import PrepareHow, prepare
from hftrain.model.tokenizer import gpt2_tokenizer
from hftrain.parallel.readers import ReaderLayout, default_window
from hftrain.recipe.load import load_recipe

SEQ, BATCH = 256, 8


def write_shards(root: Path, shards: int = 8) -> list[Path]:
    docs = [d for d in (module_docstrings(f) for f in python_docs_files()) if d]
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(shards):
        path = root / f"part-{i:02d}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs[i::shards])
        paths.append(path)
    return paths


def gpu_consumption(a: argparse.Namespace) -> tuple[float, str]:
    """Tokens/s one GPU trains --recipe at, as `hftrain plan --gpus N --gpu-mem-gb M --gpu-type T` times its step."""
    from hftrain.planning import fit as fitting
    from hftrain.planning.estimates import plan
    from hftrain.planning.part import PlanPart
    from hftrain.speed.hardware import spec_bf16_tflops

    part = PlanPart.of(load_recipe(a.recipe, []))
    info = plan(part)
    machine = fitting.gpus(a.gpus, a.gpu_mem_gb)
    chosen = fitting.choose(part, info, machine, None)
    tflops, card = spec_bf16_tflops(a.gpu_type)
    if not tflops:
        sys.exit(f"--gpu-type {a.gpu_type!r}: no data-sheet peak known")
    seconds = fitting.step_time(info, chosen, tflops * 1e12, a.mfu)
    tokens = chosen.shape.micro_batch * chosen.accumulation * chosen.shape.seq_len
    about = (
        f"{Path(a.recipe).stem} on {machine.description} ({card}): micro-batch {chosen.shape.micro_batch} x "
        f"{chosen.shape.seq_len}, "
        f"{seconds:,.3f} s per step of {tokens:,} tokens at MFU {a.mfu:.2f} of {tflops:,.0f} TFLOP/s"
    )
    return tokens / seconds, about


def worker_counts(cores: int) -> list[int]:
    """0, 1, 2, 4, ... and the core count itself."""
    counts = [0] + [2**i for i in range(cores.bit_length()) if 2**i <= cores]
    return sorted(set(counts + [cores]))


def workers_vs_gpu(a: argparse.Namespace, tmp: Path) -> list[str]:
    """The per-worker table: raw text and prepared shards at each worker count, medians over the repeats (taken in
    turn, so that each count sees the same noise), beside the GPU's consumption."""
    from hftrain.data.input_rate import wait_share

    consumed, about = gpu_consumption(a)
    data = load_recipe(a.recipe, []).data
    # no shuffle window: the same work per token without its bursts (a window fill stalls the first batch, then the
    # window's blocks come at once); over a run the rate is the same, and it is what `train` measures (input_rate.py)
    shape = {"seq_len": a.seq or data.seq_len, "eval_blocks": 2, "holdout_every": 10, "shuffle_window": 1}
    raw = {"train": {"path": str(tmp / "local" / ("part-00.jsonl.gz" if a.dry_run else "*.jsonl.gz"))}, **shape}
    part = DataPart.of(load_recipe(None, {"data": raw, "tokenizer": {"builtin": "gpt2"}}))
    prepare(part, str(tmp / "workers-prepared"), PrepareHow(workers=1 if a.dry_run else None))
    paths = {"raw text": raw, "token folder": {"train": {"pretokenized": str(tmp / "workers-prepared")}, **shape}}
    counts = a.workers or worker_counts(os.cpu_count() or 1)
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.repeats):
        for w in counts:
            for name, section in paths.items():
                rates.setdefault((name, w), []).append(data_rate(section, a.tokens, w))
    lines = [f"GPU: {consumed:,.0f} tokens/s ({about})"]
    for w in counts:
        cells = []
        for name in paths:
            rate = statistics.median(rates[(name, w)])
            per = rate / max(w, 1)
            cells.append(
                f"{name} {rate:,.0f} tok/s ({per:,.0f} per worker, {rate / consumed:,.2f}x the GPU, wait "
                f"{100 * wait_share(consumed, per, w):.0f}%)"
            )
        lines.append(f"workers {w}: " + " | ".join(cells))
    return lines


def data_rate(section_raw: dict, tokens: int, workers: int) -> float:
    recipe = load_recipe(None, {"data": section_raw, "tokenizer": {"builtin": "gpt2"}})
    plan = plan_data(recipe.data, 0)
    readers = max(workers, 1)
    window = recipe.data.shuffle_window or default_window(readers, recipe.data.seq_len)
    layout = ReaderLayout(readers=readers, processes=1, workers=readers, window=window)
    loader = ResumableLoader(PackedDataset(plan, gpt2_tokenizer(), 0, layout), BATCH, workers)
    it, seen = iter(loader), 0
    next(it)  # start-up (worker spawn, first window) is not throughput
    start = time.perf_counter()
    while seen < tokens:
        seen += next(it)["input_ids"].numel()
    return seen / (time.perf_counter() - start)


def write_corpus(root: Path, megabytes: int, shards: int = 8) -> Path:
    """Plain JSONL shards of about `megabytes` MB in all: the standard library's docstrings, repeated."""
    docs = [d for d in (module_docstrings(f) for f in python_docs_files()) if d]
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    root.mkdir(parents=True, exist_ok=True)
    per_shard = megabytes * 2**20 // shards
    for i in range(shards):
        with (root / f"part-{i:02d}.jsonl").open("w", encoding="utf-8") as f:
            written = 0
            while written < per_shard:
                f.write(lines)
                written += len(lines)
    return root


BASELINE_REV = "d23420b"  # the last revision with the process pool (data/prepare_pool.py)


def prepare_rates(corpus: Path, out: Path, repeats: int, rev: str) -> dict[tuple[str, int], float]:
    """Median tokens/s of `hftrain data prepare` here (datatrove) and at `rev` (the pool), each a command on the same
    corpus, on 1 and 2 workers, taken in turn so both see the same noise."""
    import subprocess

    recipe = out / "r.yaml"
    out.mkdir(parents=True, exist_ok=True)
    recipe.write_text(
        json.dumps({"data": {"train": {"path": str(corpus)}, "seq_len": SEQ}, "tokenizer": {"builtin": "gpt2"}})
    )
    tree = out / "baseline"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
    )
    sides = {
        "datatrove": (ROOT, "--workers", lambda d: json.loads((d / "prepared.json").read_text())["tokens"]),
        "pool": (tree, "--processes", lambda d: json.loads((d / "manifest.json").read_text())["tokens"]),
    }
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(repeats):
            for workers in (1, 2):
                for side, (root, flag, tokens) in sides.items():
                    folder = out / f"{side}-{workers}-{r}"
                    cmd = [
                        sys.executable,
                        "-m",
                        "hftrain",
                        "data",
                        "prepare",
                        str(recipe),
                        "--out",
                        str(folder),
                        flag,
                        str(workers),
                    ]
                    start = time.perf_counter()
                    subprocess.run(
                        cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, check=True, capture_output=True
                    )
                    rates.setdefault((side, workers), []).append(tokens(folder) / (time.perf_counter() - start))
                    shutil.rmtree(folder)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return {k: statistics.median(v) for k, v in rates.items()}


def training_rate(data: Path, out: Path) -> float:
    raw = {
        "model": {"preset": "cpu-medium"},
        "tokenizer": {"builtin": "gpt2"},
        "data": {"train": {"path": str(data)}, "seq_len": SEQ, "eval_blocks": 2, "holdout_every": 5},
        "training": {
            "output_dir": str(out),
            "max_steps": 25,
            "per_device_train_batch_size": BATCH,
            "logging_steps": 5,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }
    run = hftrain.train(load_recipe(None, raw))
    rates = [e["tokens_per_s"] for e in run.log_history if "tokens_per_s" in e][1:]  # after warm-up
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> list[str]:
    from hftrain.planning.fit import GPU_MFU

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens read per data measurement")
    parser.add_argument("--prepare-mb", type=int, default=100, help="size of the corpus `data prepare` is timed on")
    parser.add_argument("--prepare-repeats", type=int, default=1)
    parser.add_argument(
        "--baseline-rev", default=BASELINE_REV, help="the revision whose `data prepare` is the baseline"
    )
    parser.add_argument("--sections", default="workers,paths,prepare", help="which to run: workers, paths, prepare")
    parser.add_argument(
        "--workers",
        type=lambda v: [int(w) for w in v.split(",")],
        help="worker counts (default 0, 1, 2, 4, ... the cores)",
    )
    parser.add_argument(
        "--recipe", default=str(ROOT / "recipes" / "pretrain" / "pythia-160m.yaml"), help="the GPU's recipe"
    )
    parser.add_argument("--seq", type=int, help="data seq_len (default: the recipe's)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs, as `hftrain plan --gpus N` takes them")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0)
    parser.add_argument("--gpu-type", default="H100 SXM", help="the card whose data-sheet bf16 peak times the step")
    parser.add_argument("--mfu", type=float, default=GPU_MFU)
    parser.add_argument("--dry-run", action="store_true", help="the workers section at a tiny size: the plumbing only")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.sections, args.repeats, args.tokens, args.seq, args.workers = (
            "workers",
            1,
            4096,
            128,
            args.workers or [0, 1],
        )
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_shards(tmp / "local")
        lines = workers_vs_gpu(args, tmp) if "workers" in sections else []
        print("\n".join(lines), flush=True)
        if "paths" in sections:
            lines += streaming_vs_training(args, tmp)
    if "prepare" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            prep = prepare_rates(
                write_corpus(Path(tmp) / "corpus", args.prepare_mb),
                Path(tmp) / "prep",
                args.prepare_repeats,
                args.baseline_rev,
            )
        for w in (1, 2):
            new, old = prep[("datatrove", w)], prep[("pool", w)]
            lines.append(
                f"prepare {w} worker(s): datatrove {new:,.0f} tok/s ({new / w:,.0f} per core), pool {old:,.0f} tok/s "
                f"({old / w:,.0f} per core), ratio {new / old:.2f}"
            )
            print(lines[-1], flush=True)
    return lines


def streaming_vs_training(args: argparse.Namespace, tmp: Path) -> list[str]:
    """Each data path at the default worker count on a CPU beside a CPU run's training tokens/s."""
    workers = 0  # hftrain's default dataloader_num_workers on a CPU
    paths = {"local-stream": {"train": {"path": str(tmp / "local" / "*.jsonl.gz")}}}
    server = None
    try:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="bench")
        for p in (tmp / "local").iterdir():
            s3.upload_file(str(p), "bench", f"corpus/{p.name}")
        paths["s3-stream"] = {"train": {"path": "s3://bench/corpus/*.jsonl.gz"}}
    except ImportError:
        print("moto not installed: skipping the S3 path (pip install -e '.[test]')")
    prep_recipe = load_recipe(
        None, {"data": {**paths["local-stream"], "seq_len": SEQ}, "tokenizer": {"builtin": "gpt2"}}
    )
    prepare(DataPart.of(prep_recipe), str(tmp / "prepared"))
    paths["pretokenized"] = {"train": {"pretokenized": str(tmp / "prepared")}}
    results: dict[str, list[float]] = {name: [] for name in paths}
    training: list[float] = []
    for r in range(args.repeats):
        for name, section in paths.items():
            results[name].append(data_rate({**section, "seq_len": SEQ}, args.tokens, workers))
        training.append(training_rate(tmp / "local" / "part-00.jsonl.gz", tmp / f"train-{r}"))
        print(
            f"repeat {r + 1}: "
            + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in results.items())
            + f", training {training[-1]:,.0f} tok/s",
            flush=True,
        )
    if server is not None:
        server.stop()
    train_rate = statistics.median(training)
    lines = []
    for name, values in results.items():
        rate = statistics.median(values)
        lines.append(
            f"{name}: data {rate:,.0f} tok/s, training {train_rate:,.0f} tok/s, ratio {rate / train_rate:,.1f}"
        )
    print("\n" + "\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
