"""Peak memory of fine-tuning methods on one >=150M-parameter NeoX, next to `hftrain plan`'s prediction.

    python benchmarks/finetune_memory.py [--steps 3] [--methods full,lora,qlora,lora_8bit]

Builds the pythia-160m preset from random weights (no download) and saves it to a temp dir, then runs
`hftrain.train` on the shipped instruction data (recipes/finetune/data/) for a few steps per method, each in a fresh
subprocess, and reads its RSS high-water mark (VmHWM) while loading and during the training steps. An "imports
only" child gives what the libraries cost. Also loads the qlora model through hftrain's own loader and measures its
4-bit weight bytes against the same weights in bf16: for the quantized layers (goal <= 0.30) and the whole model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("full", "lora", "qlora", "lora_8bit")
SEQ, BATCH = 128, 4


def recipe_for(base: Path, method: str, out: Path, steps: int) -> dict:
    data = ROOT / "recipes" / "finetune" / "data" / "train.jsonl"
    return {
        "model": {"from_pretrained": str(base)},
        "tokenizer": {"path": str(base)},
        "data": {"train": {"path": str(data), "format": "prompt_completion"}, "seq_len": SEQ, "eval_blocks": 2},
        "finetune": {"method": method, "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}},
        "training": {
            "output_dir": str(out),
            "max_steps": steps,
            "per_device_train_batch_size": BATCH,
            "learning_rate": 1e-4,
            "logging_steps": 1,
            "save_steps": 10_000,
            "eval_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
        },
        "monitor": {"peak_tflops": 1.0, "sample_max_new_tokens": 0, "plot": False},
    }


def reset_peak() -> None:
    """Linux >= 4.0: restart the high-water mark (writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark. Linux: VmHWM (getrusage's ru_maxrss survives exec: it would start at
    the forking parent's RSS, and the parent here holds a 160M model)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: approximate


def child(method: str, base: Path, out: Path, steps: int) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import bitsandbytes  # noqa: F401  (imported in every child, so the baseline is the same)
    import peft  # noqa: F401

    import hftrain
    from hftrain.recipe.load import load_recipe

    result = {"method": method, "import_rss": peak_rss_bytes()}
    if method != "imports":
        from transformers import TrainerCallback

        class Peaks(TrainerCallback):
            """Loading peaks apart from training peaks: the high-water mark is reset when training begins."""

            def on_train_begin(self, *args, **kwargs):
                result["load_peak"] = peak_rss_bytes()
                reset_peak()

            def on_train_end(self, *args, **kwargs):  # before the final save (LoRA then merges into a fresh fp32 base)
                result["peak_rss"] = peak_rss_bytes()

        start = time.perf_counter()
        run = hftrain.train(load_recipe(None, recipe_for(base, method, out, steps)), callbacks=[Peaks()])
        losses = [e["loss"] for e in run.log_history if "loss" in e]
        result.update(seconds=round(time.perf_counter() - start, 1), first_loss=losses[0], last_loss=losses[-1])
    result.setdefault("peak_rss", peak_rss_bytes())
    print("RESULT " + json.dumps(result), flush=True)


def weight_bytes(model) -> dict[str, float]:
    """Bytes of the loaded weights: packed 4-bit data plus quantization constants (absmax, nested absmax, code maps)."""
    quantized = quantized_bf16 = other = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__ == "Linear4bit":
            qs = weight.quant_state
            tensors = [weight, qs.absmax, qs.code] + ([qs.state2.absmax, qs.state2.code] if qs.nested else [])
            quantized += sum(t.numel() * t.element_size() for t in tensors)
            quantized_bf16 += 2 * module.in_features * module.out_features
    seen = {id(m.weight) for m in model.modules() if type(m).__name__ == "Linear4bit"}
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) not in seen:
            other += p.numel() * p.element_size()
    return {"quantized": quantized, "quantized_bf16": quantized_bf16, "other": other}


def build_base(root: Path) -> Path:
    """pythia-160m from random weights, saved like a pretrained model (hftrain's own model and tokenizer code)."""
    from hftrain.model.build import build_model
    from hftrain.model.part import ModelPart
    from hftrain.model.tokenizer import gpt2_tokenizer
    from hftrain.recipe.load import load_recipe

    tok = gpt2_tokenizer()
    model = build_model(ModelPart.of(load_recipe(None, {"model": {"preset": "pythia-160m"}})), tok, False)
    base = root / "pythia-160m-random"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "BASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], Path(args.child[1]), Path(args.child[2]), args.steps)

    from hftrain.model.build import load_pretrained
    from hftrain.model.part import ModelPart
    from hftrain.planning.estimates import plan
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    with tempfile.TemporaryDirectory(prefix="hftrain-ftmem-") as tmp:
        root = Path(tmp)
        base = build_base(root)
        qlora = load_recipe(None, recipe_for(base, "qlora", root / "unused", args.steps))
        info = plan(PlanPart.of(qlora))
        predicted = info["finetune_bytes"]
        total = info["parameters"]["total"]
        print(
            f"model: pythia-160m preset, random weights, {total:,} "
            f"parameters; {args.steps} steps, batch {BATCH} x {SEQ} tokens"
        )

        loaded = weight_bytes(load_pretrained(ModelPart.of(qlora)))  # hftrain's own loader: bf16 + NF4, double quant
        whole_4bit = loaded["quantized"] + loaded["other"]
        print("qlora weights as loaded (NF4, double quant; embeddings, head and norms bf16):")
        print(
            f"  quantized layers: {loaded['quantized'] / 1e6:,.1f} MB vs {loaded['quantized_bf16'] / 1e6:,.1f} MB in "
            f"bf16 = ratio {loaded['quantized'] / loaded['quantized_bf16']:.3f} (plan: "
            f"{predicted['ratio_quantized_layers']:.3f}; goal <= 0.30)"
        )
        print(
            f"  whole model:      {whole_4bit / 1e6:,.1f} MB vs {2 * total / 1e6:,.1f} MB in bf16 = "
            f"ratio {whole_4bit / (2 * total):.3f} (plan: {predicted['ratio_whole_model']:.3f})"
        )

        rows = []
        for method in ["imports", *args.methods.split(",")]:
            cmd = [
                sys.executable,
                __file__,
                "--steps",
                str(args.steps),
                "--child",
                method,
                str(base),
                str(root / method),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.exit(f"{method} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(line.removeprefix("RESULT ")))
        baseline = rows[0]["peak_rss"]
        print(
            f"peak RSS per method, fresh process each (libraries alone: {baseline / 1e9:.2f} GB). loading = up to the "
            "first step (fp32 weights are mapped from the file lazily; "
            "qlora/8-bit quantize a bf16 copy); training = the steps alone:"
        )
        print(
            f"  {'method':<10} {'loading':>9} {'training':>9} {'training - libs':>16} "
            f"{'plan: weights+grads+AdamW':>26} {'loss first->last':>17} {'time':>6}"
        )
        for r in rows[1:]:
            m = predicted["methods"][r["method"]]
            plan_total = m["weights"] + m["gradients"] + m["optimizer"]
            print(
                f"  {r['method']:<10} {r['load_peak'] / 1e9:>6.2f} GB {r['peak_rss'] / 1e9:>6.2f} GB "
                f"{(r['peak_rss'] - baseline) / 1e9:>13.2f} GB "
                f"{plan_total / 1e9:>23.2f} GB {r['first_loss']:>8.3f}->{r['last_loss']:.3f} {r['seconds']:>5.0f}s"
            )
        print(
            "  (training - libs - plan ~ activations, fp32 logits over the 50,304-token vocabulary included; full "
            "fine-tuning frees them before AdamW's state exists, so they add less there)"
        )


if __name__ == "__main__":
    main()
