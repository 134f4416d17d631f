"""Training throughput: hftrain with its default settings vs a plain run_clm-style Trainer script, side by side.

    python benchmarks/throughput.py [--shapes small,medium,large] [--repeats N] [--steps N] [--run-steps N]
                                    [--hftrain-set KEY=VALUE ...] [--device cpu|cuda] [--json PATH]

--device cuda (shape gpu-160m): the baseline keeps TrainingArguments' defaults (fp32, run_clm.py without --bf16),
hftrain its own (bf16; compile for a long run); MFU also against the spec-sheet peak (gpu_peaks.py).

For each model shape, alternating A/B (the order flips every repeat), each run in its own fresh process. The
sides of a pair take turns (--turn-steps, _turns.py): each starts alone when its first turn comes, then they
alternate every ~1/12 of the measured steps (char: 20 steps, about a second), a waiting side idle, so that a
shared host's slow phases (seconds long) fall on every side rather than on one whole run:

Both sides are configured for the same run of --run-steps optimizer steps (default 2000: max_steps and the
cosine schedule; hftrain's defaults decide torch.compile by it, as for any run) and both stop after its first
--steps steps, which are measured.

  hftrain   hftrain.train(hftrain.load_recipe(None, overrides)) where the overrides set only the model shape, the
            data (the python-docs training documents as 8 JSONL shards, the same text the other sides read; its
            held-out documents as validation), tokenizer (gpt2, or the char one), seq_len, micro-batch, step count,
            learning rate, warm-up, logging interval and output_dir, and turn off what is not training (end-of-run
            sample, plot, checkpoints; the final save and evaluation run after the timed steps). Everything else, bf16,
            torch.compile, threads, data loading included, is hftrain's default.
  baseline  the way transformers' examples/pytorch/language-modeling/run_clm.py does it: the same documents
            hftrain trains on, as text, datasets.Dataset.from_dict + map(tokenize) + map(group_texts) into
            seq_len blocks, GPTNeoXForCausalLM(GPTNeoXConfig(same shape, vocabulary 50,304 = gpt2 padded to a
            multiple of 128, as hftrain sizes it)), default TrainingArguments(use_cpu=True) and
            Trainer(data_collator=default_data_collator). Optimizer hyper-parameters and the cosine schedule are
            set to hftrain's (weight decay 0.1, beta2 0.95, seed 1234), so that the losses compare.

Both sides get the same StepClock callback. tokens/s = median over the steps after warm-up (first 20%, at least
2: steps are seconds long) of tokens per step / step time (on_step_end to on_step_end, so data loading and
logging count), then the median over repeats. "warm-up s" is the time of the warm-up steps: it holds torch.compile's
compile time when a side compiles. MFU = tokens/s x training FLOPs per token (hftrain.model.shape.flops_per_token, 6N +
12LdT) / the matmul peak of the dtype the side computes in (observed on its first Linear layer), measured in this run.
loss = mean of the last 3 logged training losses (both sides log every --log-steps steps); over a few steps it mostly
tells which text each side drew (hftrain streams a shuffle window of documents, the baseline samples blocks of
the whole corpus), so "held-out" is the learning check: the mean fp32 loss of each trained model on the same
16 blocks of held-out documents that neither side trains on. Over a few steps even that depends on which
blocks a seed's order happened to draw (one seed at the small shape: 6.31 to 6.60 for the same hftrain run with
different shuffle windows), so repeat r runs every side with seed 1234 + r (model initialisation and data
order), and the held-out loss reported is the median over those seeds; a line per shape lists every seed's.
--hftrain-set measures a lever against the defaults (e.g. --hftrain-set training.torch_compile=false).

Time: each run is a fresh process (~15-25 s of imports, data set-up, final save and evaluation on a busy machine,
none of it timed). The defaults (one A/B pair per shape, 40 / 12 / 8 / 240 steps) take about 9 minutes on a 2-core CPU
shared with other work, about half that on a quiet one; there, --repeats 3 gives medians over repeats. The
machine may be shared: read the ratios. Ends with one line per shape:

    SHAPE: hftrain X tok/s, baseline Y tok/s, ratio Z, loss hftrain A baseline B, held-out loss hftrain C baseline D
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import PeakFlops, StepClock, final_loss, steady_state, write_json
from benchmarks._throughput_report import LOOP, SIDES, json_summary, print_tables, summarize
from benchmarks._turns import TURNS_PER_RUN, Turns, run_pair, turn_steps

# name: layers, heads, hidden, context, micro-batch, learning rate, default steps and logging interval. The step
# counts keep the default run under 10 minutes on a busy 2-core CPU, where a medium step takes 5-10 s.
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(layers=4, heads=4, hidden=128, seq=64, batch=12, lr=2e-3, steps=40, log_steps=5),
    "medium": dict(layers=6, heads=6, hidden=384, seq=256, batch=8, lr=1e-3, steps=12, log_steps=2),
    "large": dict(layers=8, heads=8, hidden=512, seq=256, batch=8, lr=1e-3, steps=8, log_steps=2),
    # character-level: where hftrain's own per-step overhead shows; also run by the minimal loop (side "loop").
    # 240 steps of ~50 ms: the host's slow phases last seconds, and 80 steps gave 0.89-1.19 for the same code
    "char": dict(layers=4, heads=4, hidden=128, seq=64, batch=12, lr=2e-3, steps=240, log_steps=20, char=True),
    # GPU shapes (--device cuda): the pythia-160m shape at 2048 tokens of context
    "gpu-160m": dict(layers=12, heads=12, hidden=768, seq=2048, batch=8, lr=6e-4, steps=20, log_steps=4),
}
SEED = 1234  # hftrain's default training.seed
RUN_STEPS = 2000  # the run both sides are configured for (max_steps); both stop after --steps of it
WARMUP = 2  # learning-rate warm-up steps: short, so that the measured first steps already learn


def schedule(shape: dict[str, Any], run_steps: int) -> dict[str, Any]:
    """The hyper-parameters both sides share: a run of `run_steps` steps (measured over its first steps)."""
    return {
        "max_steps": run_steps,
        "per_device_train_batch_size": shape["batch"],
        "learning_rate": shape["lr"],
        "warmup_steps": WARMUP,
    }


class DtypeProbe:
    """Records the output dtype of the model's first Linear layer: the dtype its matmuls really run in."""

    def __init__(self) -> None:
        self.dtype = "unknown"

    def attach(self, model: Any) -> None:
        import torch

        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(self._hook)

    def _hook(self, module: Any, inputs: Any, output: Any) -> None:
        self.dtype = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}.get(
            str(output.dtype), str(output.dtype)
        )


class ProbingClock(StepClock):
    """The step clock, plus the compute dtype, plus the early stop after the measured steps, plus the turns
    the sides of a pair take (_turns.py)."""

    def __init__(self, stop_after: int) -> None:
        super().__init__()
        self.probe = DtypeProbe()
        self.stop_after = stop_after
        self.turns = Turns.from_env()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_step_end(args, state, control, **kwargs)
        if self.turns:
            self.waited[-1] = self.turns.after_step(state.global_step, self.stop_after)
        if state.global_step >= self.stop_after:
            control.should_training_stop = True

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.probe.attach(model)
        super().on_train_begin(args, state, control, **kwargs)
        self.wall_at_train_begin = time.time()

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "wall_at_train_begin": self.wall_at_train_begin}


def child_result(
    clock: ProbingClock | dict[str, Any], model: Any, args: Any, log_history: list, seq: int
) -> dict[str, Any]:
    import torch

    from hftrain.model.shape import flops_per_token, parameter_counts

    counts = parameter_counts(model)
    return {
        "clock": clock if isinstance(clock, dict) else clock.to_json(),
        "tokens_per_step": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * seq,
        "loss": final_loss(log_history),
        "losses": [e["loss"] for e in log_history if "loss" in e],
        "dtype": clock.probe.dtype if not isinstance(clock, dict) else "fp32",
        "args_bf16": bool(args.bf16),
        "torch_compile": bool(args.torch_compile),
        "threads": torch.get_num_threads(),
        "workers": args.dataloader_num_workers,
        "parameters": counts["total"],
        "flops_per_token": flops_per_token(counts, model.config, seq),
    }


def hftrain_recipe(
    shape: dict[str, Any],
    out: Path,
    run_steps: int,
    log_steps: int,
    docs_dir: Path,
    tokenizer_dir: str | None = None,
    seed: int = SEED,
) -> dict[str, Any]:
    """hftrain's side of a shape as a recipe (tests/test_gpu_tier.py validates every shape's on a CPU)."""
    from benchmarks._loop import context

    return {
        "model": {
            "preset": "cpu-small",
            "num_hidden_layers": shape["layers"],
            "hidden_size": shape["hidden"],
            "num_attention_heads": shape["heads"],
            "intermediate_size": 4 * shape["hidden"],
            "max_position_embeddings": context(shape),
        },
        "tokenizer": {"path": tokenizer_dir} if tokenizer_dir else {"builtin": "gpt2"},
        "data": {
            "train": [{"path": str(docs_dir / "train-docs")}],
            "validation": {"path": str(docs_dir / "heldout-docs.jsonl")},
            "seq_len": shape["seq"],
            "eval_blocks": 4,
        },
        "training": {
            **schedule(shape, run_steps),
            "output_dir": str(out),
            "logging_steps": log_steps,
            "save_steps": run_steps + 1,
            "seed": seed,
        },
        "monitor": {"sample_max_new_tokens": 0, "plot": False},
    }


def run_hftrain(
    shape: dict[str, Any],
    steps: int,
    log_steps: int,
    out: Path,
    run_steps: int,
    settings: list[str],
    heldout: Path,
    docs_dir: Path,
    device: str = "cpu",
    tokenizer_dir: str | None = None,
    seed: int = SEED,
) -> dict[str, Any]:
    import yaml

    import hftrain

    overrides = hftrain_recipe(shape, out, run_steps, log_steps, docs_dir, tokenizer_dir, seed)
    if device == "cpu" and _cuda():
        overrides["training"]["use_cpu"] = True
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-recipe.yaml").write_text(yaml.safe_dump(overrides), encoding="utf-8")
    clock = ProbingClock(steps)
    run = hftrain.train(hftrain.load_recipe(out / "bench-recipe.yaml", settings), callbacks=[clock])
    result = child_result(clock, run.trainer.model, run.trainer.args, run.log_history, shape["seq"])
    result["heldout_loss"] = heldout_loss(run.model, heldout)
    results_file = out / "results.json"  # what hftrain itself reports, for reference
    result["hftrain_reported"] = (
        json.loads(results_file.read_text()).get("tokens_per_s_median") if results_file.is_file() else None
    )
    return result


def run_baseline(
    shape: dict[str, Any],
    steps: int,
    log_steps: int,
    out: Path,
    docs_file: Path,
    run_steps: int,
    heldout: Path,
    device: str = "cpu",
    tokenizer_dir: str | None = None,
    seed: int = SEED,
) -> dict[str, Any]:
    """transformers' run_clm.py, reduced to what this comparison needs."""
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    from benchmarks._loop import clm_blocks, load_tokenizer, neox_model

    tokenizer = load_tokenizer(tokenizer_dir)
    train_dataset = clm_blocks(docs_file, tokenizer, shape["seq"])
    set_seed(seed)
    model = neox_model(shape, tokenizer)
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=device == "cpu",
        **schedule(shape, run_steps),
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        adam_beta2=0.95,
        seed=seed,
        report_to=[],
        save_strategy="no",
        logging_steps=log_steps,
    )
    clock = ProbingClock(steps)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
        callbacks=[clock],
    )
    trainer.train()
    return {
        **child_result(clock, trainer.model, trainer.args, trainer.state.log_history, shape["seq"]),
        "heldout_loss": heldout_loss(trainer.model, heldout),
    }


def run_minimal_loop(
    shape: dict[str, Any],
    steps: int,
    log_steps: int,
    docs_file: Path,
    run_steps: int,
    heldout: Path,
    tokenizer_dir: str | None,
    seed: int = SEED,
) -> dict[str, Any]:
    from benchmarks._loop import run_loop

    model, _, args, history, clock = run_loop(
        shape, steps, log_steps, docs_file, run_steps, seed, WARMUP, tokenizer_dir
    )
    return {**child_result(clock, model, args, history, shape["seq"]), "heldout_loss": heldout_loss(model, heldout)}


def training_documents() -> list[str]:
    """The documents hftrain trains on: the python-docs corpus minus its held-out documents, in corpus order."""
    from hftrain.data.loader import plan_data, train_documents
    from hftrain.recipe.load import load_recipe

    recipe = load_recipe(None, {"data": {"train": [{"builtin": "python-docs"}]}})
    stream = train_documents(plan_data(recipe.data, SEED), loop=False)
    stream.shuffle = False
    return list(stream.documents(stream.fresh_state()))


SHARDS = 8  # the same documents as JSONL shards for hftrain's side: 8 readers, as a sharded corpus gives


def write_shards(documents: list[str], held_out: list[str], where: Path) -> None:
    """The documents every side trains on, as hftrain reads a sharded corpus (train-docs/part-NN.jsonl, in corpus
    order), and the held-out ones as its validation source: all sides read the same text, already extracted."""
    (where / "train-docs").mkdir(parents=True, exist_ok=True)
    for k in range(SHARDS):
        part = documents[k * len(documents) // SHARDS : (k + 1) * len(documents) // SHARDS]
        (where / "train-docs" / f"part-{k:02d}.jsonl").write_text(
            "".join(json.dumps({"text": d}) + "\n" for d in part), encoding="utf-8"
        )
    (where / "heldout-docs.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in held_out), encoding="utf-8"
    )


def held_out_documents() -> list[str]:
    from hftrain.data.loader import plan_data
    from hftrain.data.sources import BadRecords
    from hftrain.data.stream import DocumentStream
    from hftrain.recipe.load import load_recipe

    recipe = load_recipe(None, {"data": {"train": [{"builtin": "python-docs"}]}})
    plan = plan_data(recipe.data, SEED)
    stream = DocumentStream(
        plan.train,
        seed=SEED,
        holdout_every=recipe.data.holdout_every,
        split="holdout",
        shuffle=False,
        loop=False,
        bad=BadRecords("fail"),
    )
    return list(stream.documents(stream.fresh_state()))


def heldout_blocks(seq: int, tokenizer_dir: str | None, count: int = 16) -> list[list[int]]:
    """Blocks of the held-out python-docs documents (neither side trains on them), as hftrain's validation set."""
    from benchmarks._loop import load_tokenizer
    from hftrain.data.loader import plan_data, validation_blocks
    from hftrain.recipe.load import load_recipe

    recipe = load_recipe(None, {"data": {"train": [{"builtin": "python-docs"}], "seq_len": seq, "eval_blocks": count}})
    return [
        b["input_ids"].tolist() for b in validation_blocks(plan_data(recipe.data, SEED), load_tokenizer(tokenizer_dir))
    ]


def heldout_loss(model: Any, path: Path) -> float:
    """Mean loss of the trained model on the shared held-out blocks, in fp32: the same yardstick for both sides
    (training losses over a few steps mostly tell which text each side happened to draw)."""
    import torch

    model.eval()
    with torch.no_grad():
        blocks = [torch.tensor([b], device=model.device) for b in json.loads(path.read_text())]
        losses = [float(model(input_ids=b, labels=b).loss) for b in blocks]
    return sum(losses) / len(losses)


def child_main(args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    out = Path(args.workdir)
    if args.child == "hftrain":
        result = run_hftrain(
            shape,
            args.steps,
            args.log_steps,
            out,
            args.run_steps,
            args.hftrain_set,
            Path(args.heldout),
            Path(args.docs).parent,
            args.device,
            args.tokenizer,
            int(args.seed),
        )
    elif args.child == LOOP:
        result = run_minimal_loop(
            shape,
            args.steps,
            args.log_steps,
            Path(args.docs),
            args.run_steps,
            Path(args.heldout),
            args.tokenizer,
            int(args.seed),
        )
    else:
        result = run_baseline(
            shape,
            args.steps,
            args.log_steps,
            out,
            Path(args.docs),
            args.run_steps,
            Path(args.heldout),
            args.device,
            args.tokenizer,
            int(args.seed),
        )
    result["spawned_at"] = float(args.spawned_at)
    write_json(args.result, result)
    turns = Turns.from_env()
    if turns:
        turns.finished()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,medium,large,char", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="A/B pairs per shape; the order flips at every pair, across shapes too (default 1: "
        "about 9 minutes on a busy 2-core CPU; use 3 or more on a quiet machine)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps measured per run (default: per shape, see SHAPES)"
    )
    parser.add_argument(
        "--run-steps",
        type=int,
        default=RUN_STEPS,
        help="max_steps both sides are configured with (the learning-rate schedule, and what hftrain's "
        "defaults decide torch.compile by); both stop after --steps (default %(default)s)",
    )
    parser.add_argument(
        "--hftrain-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the hftrain side (repeatable), to measure a lever against the defaults",
    )
    parser.add_argument(
        "--turn-steps",
        type=int,
        default=None,
        help="steps per turn: the sides of a pair run at once but take turns, so the host's slow phases "
        f"fall on every side (default: about {TURNS_PER_RUN} turns per run; 0: one side after another)",
    )
    parser.add_argument("--log-steps", type=int, default=None, help="logging_steps on both sides (default: per shape)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where both sides train (default %(default)s)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON (scripts/gpu_check.sh reads it)")
    parser.add_argument("--child", choices=(*SIDES, LOOP), help=argparse.SUPPRESS)
    for hidden in ("--shape", "--workdir", "--result", "--docs", "--heldout", "--tokenizer", "--spawned-at", "--seed"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shape_list = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shape_list if s not in SHAPES]
    if unknown and not args.child:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if args.device == "cuda" and not _cuda():
        parser.error("--device cuda: no CUDA device here")
    return args


def run_pairs(args: argparse.Namespace, peaks: PeakFlops, tmp: Path) -> dict[str, dict[str, Any]]:
    """Every shape's A/B runs, each side in a fresh process; the order flips at every pair."""
    summary: dict[str, dict[str, Any]] = {}
    docs = tmp / "documents.json"
    documents = training_documents()
    docs.write_text(json.dumps(documents))
    write_shards(documents, held_out_documents(), docs.parent)
    char_tokenizer = None
    if any(SHAPES[name].get("char") for name in args.shape_list):
        from benchmarks._loop import write_char_tokenizer

        char_tokenizer = str(write_char_tokenizer(documents, tmp / "char-tokenizer"))

    def spawned() -> list[str]:  # just before a side starts (the others wait): the peak again, and the spawn time
        peaks.measure()
        return ["--spawned-at", repr(time.time())]

    pair = 0  # A/B pairs so far: the order flips at every pair, so slow drifts of the machine cancel
    for name in args.shape_list:
        steps = args.steps or SHAPES[name]["steps"]
        log_steps = args.log_steps or SHAPES[name]["log_steps"]
        tokenizer = char_tokenizer if SHAPES[name].get("char") else None
        sides = (*SIDES, LOOP) if SHAPES[name].get("char") else SIDES
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        heldout = tmp / f"heldout-{name}.json"
        heldout.write_text(json.dumps(heldout_blocks(SHAPES[name]["seq"], tokenizer)))
        for r in range(args.repeats):
            pair += 1
            order = sides if pair % 2 else sides[::-1]
            tags = {side: f"{name}-{side}-{r}" for side in order}
            cmds = [
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    side,
                    "--shape",
                    name,
                    "--steps",
                    str(steps),
                    "--log-steps",
                    str(log_steps),
                    "--run-steps",
                    str(args.run_steps),
                    "--device",
                    args.device,
                    *(f"--hftrain-set={kv}" for kv in args.hftrain_set),
                    "--workdir",
                    str(tmp / tag),
                    "--result",
                    str(tmp / f"{tag}.json"),
                    "--docs",
                    str(docs),
                    "--heldout",
                    str(heldout),
                    *(["--tokenizer", tokenizer] if tokenizer else []),
                    "--seed",
                    str(SEED + r),
                ]
                for side, tag in tags.items()
            ]
            t0 = time.perf_counter()
            results = run_pair(
                cmds,
                [tmp / f"{tag}.log" for tag in tags.values()],
                [tmp / f"{tag}.json" for tag in tags.values()],
                tmp / f"turns-{name}-{r}",
                turn_steps(args.turn_steps, steps),
                spawned,
            )
            for side, result in zip(order, results):
                runs[side].append(result)
                s = steady_state(result["clock"], result["tokens_per_step"])
                print(
                    f"{name:<7} repeat {r + 1} {side:<9} {s['tokens_per_s']:>9,.0f} tok/s  loss {result['loss']:.4f}  "
                    f"({steps} steps; {result['workers']} data-loader workers)",
                    flush=True,
                )
            print(f"{name:<7} repeat {r + 1}: {len(order)} sides, {time.perf_counter() - t0:.0f} s in all", flush=True)
        if runs["hftrain"][0]["parameters"] != runs["baseline"][0]["parameters"]:
            print(
                f"WARNING {name}: parameter counts differ: hftrain {runs['hftrain'][0]['parameters']:,}, "
                f"baseline {runs['baseline'][0]['parameters']:,}"
            )
        summary[name] = {"runs": runs, "steps": steps}
    return summary


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(args)
    started = time.perf_counter()
    peaks = PeakFlops(args.device)
    with tempfile.TemporaryDirectory(prefix="hftrain-throughput-") as tmp:
        runs = run_pairs(args, peaks, Path(tmp))
        peaks.measure()
    summary = {
        name: {**{side: summarize(r, peaks.best, args.run_steps) for side, r in s["runs"].items()}, "steps": s["steps"]}
        for name, s in runs.items()
    }
    if args.json:
        write_json(args.json, json_summary(summary, peaks.best, args.device, time.perf_counter() - started, SHAPES))
    print_tables(summary, peaks.best, time.perf_counter() - started, SEED)


if __name__ == "__main__":
    main()
