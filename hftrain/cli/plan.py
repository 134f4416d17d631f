"""`hftrain plan RECIPE [--gpus N --gpu-mem-gb M]`: the model's size and FLOPs, the predicted peak memory per
process by component, a layout that fits (strategy, micro-batch, gradient checkpointing), and the run's time and
cost. Computed on paper (the meta device); trains nothing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hftrain.cli.numbers import fraction, positive_float, positive_int


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="print the model's size, FLOPs, peak memory, a layout that fits, time and cost"
    )
    p.add_argument("recipe")
    p.add_argument("--gpus", type=positive_int, help="plan for this many GPUs (default: the machine at hand)")
    p.add_argument("--gpu-mem-gb", type=positive_float, default=80.0, help="memory of one GPU for --gpus (default 80)")
    p.add_argument(
        "--gpu-type",
        help=(
            "with --gpus: the card whose data-sheet bf16 peak times the "
            "run (H100 SXM, H100 PCIe, H200, A100, L4; default H100 SXM)"
        ),
    )
    p.add_argument(
        "--mfu",
        type=fraction,
        help="model FLOPs utilization to assume, a fraction of the peak (default: measured by the recipe's last run, "
        "else 0.35 on GPUs, 0.50 on CPUs)",
    )
    p.add_argument(
        "--price-per-hour", type=positive_float, help="price of one device-hour (default: monitor.price_per_hour)"
    )
    return p


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.planning import fit as fitting
    from hftrain.planning.estimates import (
        format_fit,
        format_fp8,
        format_peak,
        format_peak_table,
        format_plan,
        format_time,
        plan,
    )
    from hftrain.planning.memory import library_footprint
    from hftrain.planning.part import PlanPart
    from hftrain.recipe.load import load_recipe

    card = _card(args)  # the options first: a refusal before any work is printed
    recipe = load_recipe(args.recipe, overrides)
    part = PlanPart.of(recipe)
    info = plan(part)
    print(format_plan(info, str(recipe.model.from_pretrained or recipe.model.preset)))
    machine = fitting.gpus(args.gpus, args.gpu_mem_gb) if args.gpus else fitting.this_machine()
    for line in format_fp8(info, recipe.speed.fp8, _has_fp8(card, machine)):
        print(line)
    libraries = library_footprint(measure=True) if machine.device == "cpu" else None  # this process: imports only
    configured = fitting.as_configured(part, info, machine, libraries=libraries)
    print("\n".join(format_peak(configured, machine)))
    print("\n".join(format_peak_table(part, info, machine, libraries)))
    chosen = fitting.choose(part, info, machine, libraries)
    print("\n".join(format_fit(configured, chosen)))
    peak_flops, peak_source = _peak_flops(card, machine, chosen)
    mfu, mfu_source = _mfu(args, recipe, machine)
    price = args.price_per_hour or recipe.monitor.price_per_hour
    print("\n".join(format_time(info, chosen, machine, peak_flops, peak_source, mfu, mfu_source, price)))
    return 0


def _card(args: argparse.Namespace) -> tuple[float, str] | None:
    """--gpus' card: (its data-sheet bf16 TFLOPS, its name); None when planning for the machine at hand."""
    from hftrain.errors import HftrainError
    from hftrain.speed.hardware import SPEC_BF16_TFLOPS, spec_bf16_tflops

    if not args.gpus:
        if args.gpu_type:
            raise HftrainError(
                f"--gpu-type {args.gpu_type!r} names the card of --gpus N; add --gpus, or leave it out to plan "
                "for this machine (its peak is measured)"
            )
        return None
    tflops, card = spec_bf16_tflops(args.gpu_type or "H100 SXM")
    if not tflops:
        known = ", ".join(c for _, t, c in SPEC_BF16_TFLOPS if t)
        raise HftrainError(f"--gpu-type {args.gpu_type!r}: no data-sheet peak known; give one of {known}")
    return tflops, card


def _has_fp8(card: tuple[float, str] | None, machine: Any) -> bool:
    """Whether the planned GPU has FP8 tensor cores: --gpu-type's card (H100, H200, L4; not A100), else this machine's
    first GPU by its compute capability (8.9 or newer)."""
    if card:
        return card[1].startswith(("H100", "H200", "L4"))
    if machine.device != "cuda":
        return False
    import torch

    from hftrain.speed.fp8 import FP8_CAPABILITY

    return tuple(torch.cuda.get_device_capability(0)) >= FP8_CAPABILITY


def _peak_flops(card: tuple[float, str] | None, machine: Any, chosen: Any) -> tuple[float, str]:
    """The device's peak: the data sheet's for --gpus, else measured on this machine (a half-second matmul burst,
    kept in hftrain's cache)."""
    if card:
        return card[0] * 1e12, f"dense bf16 of an {card[1]} (NVIDIA data sheet)"
    import torch

    from hftrain.speed.hardware import peak_flops_here

    dtype = torch.bfloat16 if chosen.shape.dtype == "bf16" else torch.float32
    device = torch.device("cuda" if machine.device == "cuda" else "cpu")
    flops, how = peak_flops_here(device, dtype)
    return flops, f"{chosen.shape.dtype} matmul peak {how}"


MIN_MFU_SAMPLES = 5  # log lines a run's MFU median needs before `plan` predicts from it


def _mfu(args: argparse.Namespace, recipe: Any, machine: Any) -> tuple[float, str]:
    """--mfu, else the MFU the recipe's last run measured (its results.json, from MIN_MFU_SAMPLES log lines on),
    else the stated assumption."""
    from hftrain.checkpoint.files import read_json
    from hftrain.checkpoint.layout import RunLayout
    from hftrain.errors import HftrainError
    from hftrain.planning import fit as fitting

    if args.mfu:
        return args.mfu, "--mfu"
    results, too_few = RunLayout(Path(recipe.training.output_dir)).results, ""
    if not args.gpus and results.is_file():
        try:
            recorded = read_json(results, "the run's results")
        except HftrainError:
            recorded = {}
        measured, samples = recorded.get("mfu_median"), recorded.get("mfu_samples")
        if measured and (samples is None or samples >= MIN_MFU_SAMPLES):  # None: an older results.json
            return float(measured), f"measured by the last run in {results}"
        if measured:  # a probe of a step or two: start-up and compile in its few intervals (a 33 s step for 0.14 s)
            too_few = f"; the last run in {results} logged {samples} MFU value(s), too few to go by"
    if machine.device == "cuda":
        return (
            fitting.GPU_MFU,
            "assumed: large-model training reaches 21-46% (PaLM, arXiv 2204.02311, Table 3); --mfu to change" + too_few,
        )
    return (
        fitting.CPU_MFU,
        "assumed for CPUs (pythia-160m steps measured 0.39-0.65, "
        "docs/planning.md); a run's results.json then gives this recipe's" + too_few,
    )
