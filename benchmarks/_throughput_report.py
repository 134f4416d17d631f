"""The throughput benchmark's summary: per-side medians, start-up, the wall clock of a whole run, the tables it
prints and the JSON it writes (benchmarks/throughput.py runs the sides; this reduces and reports their results)."""

from __future__ import annotations

from typing import Any

from benchmarks._common import median, steady_state, step_durations, warmup_steps

SIDES = ("hftrain", "baseline")
LOOP = "loop"  # the minimal hand-written loop: a third side, on shapes marked char


def json_summary(
    summary: dict[str, Any],
    peaks: dict[str, float],
    device: str,
    seconds: float,
    shape_table: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The per-shape numbers, ratios and peaks; on CUDA also MFU against the GPU's spec-sheet bf16 peak."""
    gpu: dict[str, Any] = {}
    if device == "cuda":
        import torch

        from benchmarks.gpu_peaks import spec_bf16_tflops

        gpu["device_name"] = torch.cuda.get_device_name()
        spec, gpu["spec_card"] = spec_bf16_tflops(gpu["device_name"])
        gpu["spec_bf16_flops"] = spec * 1e12 if spec else None
    shapes, spec = {}, gpu.get("spec_bf16_flops")
    for name, sides in summary.items():
        present = [side for side in (*SIDES, LOOP) if side in sides]
        entry = {side: {k: v for k, v in sides[side].items() if k != "rates"} for side in present}
        for side in present:
            entry[side]["mfu_spec"] = (
                sides[side]["tokens_per_s"] * sides[side]["flops_per_token"] / spec if spec else None
            )
        entry["ratio"] = sides["hftrain"]["tokens_per_s"] / sides["baseline"]["tokens_per_s"]
        entry["wall_clock_ratio"] = sides["baseline"]["wall_full_run_s"] / sides["hftrain"]["wall_full_run_s"]
        if LOOP in sides:
            entry["hftrain_over_loop"] = sides["hftrain"]["tokens_per_s"] / sides[LOOP]["tokens_per_s"]
        shapes[name] = {**shape_table[name], **entry, "steps": sides["steps"]}
    return {"device": device, **gpu, "matmul_peak_flops": peaks, "seconds": round(seconds, 1), "shapes": shapes}


def start_up(result: dict[str, Any]) -> dict[str, float]:
    """Seconds from the process start to training (imports, data, model), to the end of the first step, and to
    the end of the warm-up steps (which hold a compile)."""
    clock = result["clock"]
    setup = clock["wall_at_train_begin"] - result["spawned_at"]
    durations = step_durations(clock)
    skip = warmup_steps(len(durations))
    return {
        "setup_s": setup,
        "first_step_s": setup + durations[0],
        "to_steady_s": setup + sum(durations[:skip]),
        "warm_steps": skip,
    }


def summarize(runs: list[dict[str, Any]], peaks: dict[str, float], run_steps: int) -> dict[str, Any]:
    steady = [steady_state(r["clock"], r["tokens_per_step"]) for r in runs]
    starts = [start_up(r) for r in runs]
    # the wall clock of the whole run both sides are configured for: start-up, warm-up, then the steps at their mean
    # pace (the median would leave out what comes every so many steps: a data window's tokenizing, logging)
    walls = [st["to_steady_s"] + (run_steps - st["warm_steps"]) * sd["mean_step_s"] for st, sd in zip(starts, steady)]
    rates = [s["tokens_per_s"] for s in steady]
    rate, first = median(rates), runs[0]
    peak = peaks.get(first["dtype"], peaks["fp32"])
    return {
        "rates": rates,
        "tokens_per_s": rate,
        "mfu": rate * first["flops_per_token"] / peak,
        "cpu_util": median([s["cpu_util"] for s in steady]),
        "warmup_s": median([s["warmup_s"] for s in steady]),
        "loss": median([r["loss"] for r in runs]),
        "heldout": median([r["heldout_loss"] for r in runs]),
        "heldouts": [r["heldout_loss"] for r in runs],
        "dtype": "/".join(sorted({r["dtype"] for r in runs})),
        "compile": any(r["torch_compile"] for r in runs),
        "threads": first["threads"],
        "workers": first["workers"],
        "parameters": first["parameters"],
        "flops_per_token": first["flops_per_token"],
        "timed_steps": steady[0]["timed_steps"],
        "first_step_s": median([st["first_step_s"] for st in starts]),
        "setup_s": median([st["setup_s"] for st in starts]),
        "wall_full_run_s": median(walls),
        "run_steps": run_steps,
    }


def print_tables(summary: dict[str, Any], best: dict[str, float], seconds: float, seed: int) -> None:
    print(
        f"\nall runs took {seconds:.0f} s; tokens/s = median over repeats of the per-run median over steady-state steps"
    )
    print(
        f"matmul peak (best seen in this run): fp32 {best['fp32'] / 1e9:,.1f} "
        f"GFLOP/s, bf16 {best['bf16'] / 1e9:,.1f} GFLOP/s; "
        "cpu = CPU s per wall s in the timed steps (about the thread count when the run had the cores to itself)\n"
    )
    header = (
        f"{'shape':<7} {'side':<9} {'tok/s':>9} {'runs (tok/s)':<22} {'MFU':>6} {'dtype':<5} {'compile':<7} "
        f"{'threads':>7} {'cpu':>4} {'workers':>7} {'warm-up s':>9} {'loss':>7} {'held-out':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, sides in summary.items():
        for side in [side for side in (*SIDES, LOOP) if side in sides]:
            s = sides[side]
            runs_text = " ".join(f"{v:,.0f}" for v in s["rates"])
            print(
                f"{name:<7} {side:<9} {s['tokens_per_s']:>9,.0f} {runs_text:<22} {100 * s['mfu']:>5.1f}% "
                f"{s['dtype']:<5} {'yes' if s['compile'] else 'no':<7} {s['threads']:>7} {s['cpu_util']:>4.1f} "
                f"{s['workers']:>7} {s['warmup_s']:>9.1f} {s['loss']:>7.4f} {s['heldout']:>8.4f}"
            )
        h = sides["hftrain"]
        print(f"{'':<7} ({sides['steps']} steps, {h['timed_steps']} timed; {h['parameters']:,} parameters)")
    print()
    for name, sides in summary.items():
        h, b = sides["hftrain"], sides["baseline"]
        print(
            f"{name}: hftrain {h['tokens_per_s']:,.0f} tok/s, baseline {b['tokens_per_s']:,.0f} tok/s, "
            f"ratio {h['tokens_per_s'] / b['tokens_per_s']:.2f}, loss hftrain {h['loss']:.4f} baseline "
            f"{b['loss']:.4f}, held-out loss hftrain {h['heldout']:.4f} baseline {b['heldout']:.4f}"
        )
    for name, sides in summary.items():
        h, b = sides["hftrain"], sides["baseline"]
        seeds = ", ".join(str(seed + r) for r in range(len(h["heldouts"])))
        gap = median([x - y for x, y in zip(h["heldouts"], b["heldouts"])])
        print(
            f"{name} held-out loss by seed ({seeds}): hftrain {' '.join(f'{v:.4f}' for v in h['heldouts'])}, "
            f"baseline {' '.join(f'{v:.4f}' for v in b['heldouts'])}; median hftrain - baseline {gap:+.4f}"
        )
        print(
            f"{name} start-up: time to first step hftrain {h['first_step_s']:.1f} s, baseline {b['first_step_s']:.1f} "
            f"s; compile/warm-up steps hftrain {h['warmup_s']:.1f} s ({'compiled' if h['compile'] else 'eager'}), "
            f"baseline {b['warmup_s']:.1f} s"
        )
        print(
            f"{name} wall clock of a {h['run_steps']}-step run (start-up + warm-up + steps at their mean pace): "
            f"hftrain {h['wall_full_run_s']:,.0f} s, baseline {b['wall_full_run_s']:,.0f} s, "
            f"ratio {b['wall_full_run_s'] / h['wall_full_run_s']:.2f}"
        )
        if LOOP in sides:
            loop = sides[LOOP]
            over = h["tokens_per_s"] / loop["tokens_per_s"]
            print(
                f"{name} minimal loop: {loop['tokens_per_s']:,.0f} tok/s; hftrain / loop {over:.3f} "
                f"(hftrain's per-step overhead {100 * (1 - over):+.1f}%, {h['dtype']}, "
                f"{'compiled' if h['compile'] else 'eager'}), baseline / loop "
                f"{b['tokens_per_s'] / loop['tokens_per_s']:.3f}; time to first step loop {loop['first_step_s']:.1f} s"
            )
