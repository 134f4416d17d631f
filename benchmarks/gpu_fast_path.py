"""The GPU fast path measured: hftrain against the plain Trainer at its strongest (bf16, torch.compile, fused AdamW,
sdpa, 2 loader workers) and, where it is installed, litgpt's GPT of the same Pythia config in a minimal compiled
loop; at pythia-160m and pythia-1b, 8 x 2,048 tokens, bf16, and FP8 where the card has it. Each side runs in its own
process, one after another: the one script a lent GPU runs (docs/performance.md, "GPU fast path").

    python benchmarks/gpu_fast_path.py [--models pythia-160m,pythia-1b]
                                       [--sides hftrain,hftrain-chunked-loss,trainer,litgpt]
                                       [--fp8] [--steps 30] [--warm 10] [--out DIR] [--docs docs/performance.md]
    python benchmarks/gpu_fast_path.py --dry-run    # a tiny shape on the CPU, in this process: the plumbing only

Per side: tokens/s over the steps after warm-up, timed with one device sync at each end of the window and none
between (a side that stalls the GPU in its steps pays for it here); MFU by one formula for every side,
tokens/s x (6N + 12 L d T) / the card's dense bf16 peak (its spec sheet; the measured matmul peak for an unknown
card); peak memory (max_memory_allocated); the share of the window spent waiting for data (host side, around each
side's batch fetch); graph breaks and graphs compiled (torch._dynamo's counters). The hftrain sides differ only in
the loss (``speed.loss``: the model's own, or chunked) and FP8 (``speed.fp8``): which of them the speed defaults
should pick on a GPU is read from this table, never guessed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("hftrain", "hftrain-chunked-loss", "trainer", "litgpt")
FP8_SIDES = ("hftrain-fp8-tensorwise", "hftrain-fp8-rowwise")
LOG_EVERY = 10  # every side logs (and so reads its loss back) this often


def recipe(model: str, a: argparse.Namespace, out: Path, side: str) -> dict[str, Any]:
    """hftrain's recipe for a side: the shipped Pythia recipe on the built-in corpus (nothing to download), one
    process, no accumulation, no evaluation or checkpoint in the timed steps."""
    import yaml

    shipped = ROOT / "recipes" / "pretrain" / f"{model}.yaml"
    raw = (
        yaml.safe_load(shipped.read_text())
        if shipped.is_file()
        else {"model": {"preset": model}, "data": {}, "training": {}}
    )
    raw.pop("checkpoints", None)
    # every side on transformers' schedule and transformers' initial weights (the plain Trainer's and litgpt's sides
    # know neither gpt-neox's AnnealingLR nor its init), so the loss columns compare like with like
    raw.pop("lr_schedule", None)
    for key in ("init_method", "output_layer_init_method"):
        raw["model"].pop(key, None)
    raw["tokenizer"] = {"builtin": "gpt2"}
    raw["data"] = {"train": [{"builtin": "python-docs"}], "seq_len": a.seq, "eval_blocks": 2}
    raw["training"] = {
        **{
            k: v
            for k, v in raw["training"].items()
            if k.startswith(("adam_", "lr_", "learning_rate", "weight_decay", "max_grad"))
        },
        "output_dir": str(out / f"{side}-{model}"),
        "max_steps": a.steps,
        "per_device_train_batch_size": a.batch,
        "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
        "warmup_steps": 2,
        "save_steps": 10**6,
        "eval_strategy": "no",
        "logging_steps": LOG_EVERY,
        "report_to": "none",
        "disable_tqdm": True,
        "bf16": a.device == "cuda",
        "torch_compile": True,
        "torch_compile_backend": a.compile_backend,
        "dataloader_num_workers": 2 if a.device == "cuda" else 0,
        **({} if a.device == "cuda" else {"use_cpu": True}),
    }
    raw["monitor"] = {"sample_max_new_tokens": 0, "plot": False}
    raw["speed"] = {"loss": "chunked" if side == "hftrain-chunked-loss" else "auto"}
    if side.startswith("hftrain-fp8-"):
        raw["speed"]["fp8"] = side.removeprefix("hftrain-fp8-")
    return raw


class Window:
    """Wall time over steps warm+1..steps, with a device sync at both ends only; host time fetching batches."""

    def __init__(self, warm: int, steps: int, device: str):
        self.warm, self.steps, self.device = warm, steps, device
        self.start = self.end = 0.0
        self.waited = 0.0

    def sync(self) -> float:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def step_done(self, step: int) -> None:
        if step == self.warm:
            self.start, self.waited = self.sync(), 0.0
        elif step == self.steps:
            self.end = self.sync()

    def fetched(self, seconds: float) -> None:
        self.waited += seconds

    @property
    def seconds(self) -> float:
        return self.end - self.start


def trainer_callback(window: Window) -> Any:
    from transformers import TrainerCallback

    class Timed(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            window.step_done(state.global_step)

    return Timed()


def timed_fetch(fetch: Any, window: Window) -> Any:
    """A Trainer's get_batch_samples, its time counted as the data wait (host side)."""

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fetch(self, *args, **kwargs)
        finally:
            window.fetched(time.perf_counter() - start)

    return timed


def model_config(model: str, a: argparse.Namespace) -> Any:
    """The GPTNeoXConfig hftrain builds for the preset (the GPT-2 tokenizer's 50,257 tokens): every side's model."""
    from hftrain.model.config import build_config
    from hftrain.model.part import ModelPart
    from hftrain.recipe.load import load_recipe

    part = ModelPart.of(load_recipe(None, recipe(model, a, Path(tempfile.gettempdir()), "hftrain")))
    return build_config(part, 50257, False, eos_token_id=50256)


def side_hftrain(model: str, side: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    import hftrain
    from hftrain.training import trainer as trainer_module

    window = Window(a.warm, a.steps, a.device)
    cls = trainer_module.HftrainTrainer
    original = cls.get_batch_samples
    cls.get_batch_samples = timed_fetch(original, window)  # on the class: run() builds its own instance
    try:
        run = hftrain.train(
            hftrain.load_recipe(None, recipe(model, a, out, side)), callbacks=[trainer_callback(window)]
        )
    finally:
        cls.get_batch_samples = original
    return {
        "window": window,
        "model": run.trainer.accelerator.unwrap_model(run.trainer.model),
        "loss": last_loss(run.log_history),
    }


def side_trainer(model: str, side: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch
    from transformers import GPTNeoXForCausalLM, Trainer, TrainingArguments

    config = model_config(model, a)
    config._attn_implementation = "sdpa"
    net = GPTNeoXForCausalLM(config)
    ids = torch.randint(0, 50257, (a.batch * 16, a.seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    window = Window(a.warm, a.steps, a.device)
    args = TrainingArguments(
        output_dir=str(out / f"trainer-{model}"),
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=6e-4,
        adam_beta2=0.95,
        weight_decay=0.01,
        max_grad_norm=1.0,
        warmup_steps=2,
        bf16=a.device == "cuda",
        torch_compile=True,
        torch_compile_backend=a.compile_backend,
        optim="adamw_torch_fused",
        logging_steps=LOG_EVERY,
        save_strategy="no",
        report_to="none",
        use_cpu=a.device != "cuda",
        dataloader_num_workers=2 if a.device == "cuda" else 0,
        disable_tqdm=True,
    )
    fetching = type("Fetching", (Trainer,), {"get_batch_samples": timed_fetch(Trainer.get_batch_samples, window)})
    trainer = fetching(model=net, args=args, train_dataset=data, callbacks=[trainer_callback(window)])
    trainer.train()
    return {"window": window, "model": net, "loss": last_loss(trainer.state.log_history)}


def side_litgpt(model: str, side: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """litgpt's GPT in a minimal compiled loop (what `litgpt pretrain` trains), loaded without litgpt's package
    __init__ (it imports lightning's loggers and CLI)."""
    import importlib.util
    import types

    import torch

    spec = importlib.util.find_spec("litgpt")
    if spec is None:
        raise SystemExit("litgpt is not installed (pip install litgpt): side skipped")
    root = Path(spec.submodule_search_locations[0])
    for name, path in (("litgpt", root), ("litgpt.scripts", root / "scripts")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules.setdefault(name, module)
    convert = types.ModuleType("litgpt.scripts.convert_hf_checkpoint")
    convert.qkv_reassemble = None
    sys.modules.setdefault("litgpt.scripts.convert_hf_checkpoint", convert)
    from litgpt.config import Config
    from litgpt.model import GPT

    net = GPT(Config.from_name(model, block_size=max(a.seq, 2048))).to(a.device).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    forward = torch.compile(net, backend=a.compile_backend)
    data = torch.randint(0, 50257, (8, a.batch, a.seq + 1), device=a.device)
    window = Window(a.warm, a.steps, a.device)
    loss = None
    for step in range(1, a.steps + 1):
        x = data[step % 8]
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.device == "cuda"):
            logits = forward(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.step_done(step)
    return {"window": window, "model": net, "loss": float(loss)}


def last_loss(history: list[dict[str, Any]]) -> float | None:
    losses = [entry["loss"] for entry in history if "loss" in entry]
    return losses[-1] if losses else None


def measure(model: str, side: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One side, in this process: its numbers as one JSON-able dict."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import GPTNeoXForCausalLM

    from hftrain.model.shape import flops_per_token, parameter_counts

    torch._dynamo.reset()
    counters.clear()
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = {"trainer": side_trainer, "litgpt": side_litgpt}.get(side, side_hftrain)(model, side, a, out)
    window = run["window"]
    config = model_config(model, a)
    with torch.device("meta"):  # the same config every side trains, sized without memory
        counts = parameter_counts(GPTNeoXForCausalLM(config))
    tokens_per_s = (a.steps - a.warm) * a.batch * a.seq / window.seconds
    flops = flops_per_token(counts, config, a.seq)
    return {
        "model": model,
        "side": side,
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(tokens_per_s * flops / 1e12, 2),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if a.device == "cuda" else None,
        "data_wait_frac": round(window.waited / window.seconds, 4),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "final_loss": run["loss"],
        "window_steps": a.steps - a.warm,
    }


def child(model: str, side: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One side in a fresh process (nothing compiled or cached by another side); its last line is its JSON."""
    cmd = [sys.executable, __file__, "--side", side, "--models", model, "--out", str(out), *passthrough(a)]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.side_timeout)
    (out / f"{side}-{model}.log").write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {
            "model": model,
            "side": side,
            "error": f"exit {proc.returncode}: {tail[0][:300]}",
            "wall_s": round(time.time() - start),
        }
    return {**json.loads(lines[-1]), "wall_s": round(time.time() - start)}


def passthrough(a: argparse.Namespace) -> list[str]:
    return [
        "--steps",
        str(a.steps),
        "--warm",
        str(a.warm),
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--compile-backend",
        a.compile_backend,
    ]


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    from hftrain.speed.hardware import spec_bf16_tflops

    env = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device == "cuda":
        name = torch.cuda.get_device_name()
        spec, _ = spec_bf16_tflops(name)
        env.update(
            device=name,
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
            spec_bf16_tflops=spec,
        )
    else:
        env["device"] = "cpu (dry run)"
    return env


def table(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The markdown section for docs/performance.md: ratios against the plain Trainer and litgpt per model."""
    peak = env.get("spec_bf16_tflops")
    lines = [
        f"### {env['device']}, {env['date']} (torch {env['torch']}, transformers {env['transformers']}"
        + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
        + ")",
        "",
        "| model | side | tokens/s | vs Trainer | vs litgpt | MFU "
        "| peak GB | data wait | graph breaks / graphs | loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['side']} | failed: {row['error']} | | | | | | | |")
            continue
        base = {r["side"]: r["tokens_per_s"] for r in rows if r["model"] == row["model"] and "error" not in r}
        ratio = lambda other: f"{row['tokens_per_s'] / base[other]:.2f}x" if other in base else "-"  # noqa: E731
        mfu = f"{100 * row['tflops'] / peak:.1f}%" if peak else "-"
        loss = f"{row['final_loss']:.3f}" if row.get("final_loss") is not None else "-"
        lines.append(
            f"| {row['model']} | {row['side']} | {row['tokens_per_s']:,.0f} | {ratio('trainer')} | {ratio('litgpt')} | "
            f"{mfu} | {row['peak_mem_gb'] or '-'} | {100 * row['data_wait_frac']:.1f}% | {row['graph_breaks']} / "
            f"{row['graphs']} | {loss} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="pythia-160m,pythia-1b")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--fp8", action="store_true", help="also hftrain with speed.fp8 tensorwise and rowwise")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--side-timeout", type=int, default=300)
    p.add_argument("--out", default="runs/gpu_fast_path")
    p.add_argument("--docs", help="append the table to this markdown file (docs/performance.md)")
    p.add_argument("--dry-run", action="store_true", help="a tiny shape on the CPU, every side in this process")
    p.add_argument("--side", help=argparse.SUPPRESS)  # a child: measure this side only
    a = p.parse_args(argv)
    import torch

    a.device = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    if a.dry_run:
        a.models, a.steps, a.warm, a.batch, a.seq, a.compile_backend = "cpu-tiny", 4, 1, 2, 32, "aot_eager"
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    models = a.models.split(",")
    if a.side:
        print(json.dumps(measure(models[0], a.side, a, out)), flush=True)
        return []
    sides = [s for s in a.sides.split(",") if s] + (list(FP8_SIDES) if a.fp8 else [])
    env, rows = environment(a.device), []
    print(json.dumps(env), flush=True)
    for model in models:
        for side in sides:
            if a.dry_run and side == "litgpt":
                continue  # litgpt names Pythia shapes only
            row = measure(model, side, a, out) if a.dry_run else child(model, side, a, out)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with (out / "results.jsonl").open("a", encoding="utf-8") as f:
        for row in [env, *rows]:
            f.write(json.dumps(row) + "\n")
    section = table(rows, env)
    print(section)
    if a.docs:
        with open(a.docs, "a", encoding="utf-8") as f:
            f.write("\n" + section)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
