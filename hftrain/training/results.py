"""The end of a run in numbers: results.json (one JSON object) and the console summary."""

from __future__ import annotations

from typing import Any

from hftrain.training.step_metrics import PHASES, input_bound_advice

EVAL_TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def build_results(
    step: int, metrics: dict[str, float], log_history: list[dict[str, Any]], run_facts: dict[str, Any]
) -> dict[str, Any]:
    """results.json: the final evaluation, median throughput and MFU over the log lines, and `run_facts`
    (step-time split, precision, compile, parameters, distribution, skipped records)."""
    rates = [e["tokens_per_s"] for e in log_history if "tokens_per_s" in e]
    mfus = [e["mfu"] for e in log_history if "mfu" in e]
    return {
        "step": step,
        "eval_loss": metrics["eval_loss"],
        **{k: v for k, v in metrics.items() if k.startswith("eval_") and k not in EVAL_TIMINGS},
        "tokens_per_s_median": median(rates),
        "mfu_median": median(mfus),
        "mfu_samples": len(mfus),  # log lines behind the median: `hftrain plan` goes by it only from MIN_MFU_SAMPLES
        **run_facts,
    }


def summary(results: dict[str, Any], final_dir: Any, threshold: float, workers: int) -> list[str]:
    """The end-of-run lines printed to the console."""
    lines = [
        "",
        f"final checkpoint: {final_dir}",
        # a DPO loss is no next-token loss: no perplexity
        f"validation loss {results['eval_loss']:.4f}"
        + (
            f", perplexity {results['eval_perplexity']:.2f}, bits per byte "
            f"{results.get('eval_bits_per_byte', float('nan')):.3f}"
            if "eval_perplexity" in results
            else ""
        ),
    ]
    extra = [
        f"{k.removeprefix('eval_')} {v:.4g}"
        for k, v in results.items()
        if k.startswith("eval_") and k not in ("eval_loss", "eval_perplexity", "eval_bits_per_byte")
    ]
    if extra:
        lines.append("evaluation: " + ", ".join(extra))
    if isinstance(results.get("run_length"), dict):
        lines.append(results["run_length"]["note"])
    fill = results.get("packing_fill")
    if fill is not None and fill < 1:
        lines.append(
            f"packing: {100 * fill:.1f}% of the block tokens this process trained on are real tokens, "
            f"{100 * (1 - fill):.1f}% padding"
        )
    if results.get("time_to_first_step_s") is not None:
        lines.append(
            f"start-up: {results['time_to_first_step_s']:.1f} s from "
            "process start to the end of the first step (not in tokens/s)"
        )
    if results["tokens_per_s_median"]:
        lines.append(
            f"throughput: {results['tokens_per_s_median']:,.0f} tokens/s (median, steady state), MFU "
            f"{100 * (results['mfu_median'] or 0):.2f}%"
        )
    if results.get("data_wait_frac") is not None:
        if results["input_bound"]:
            lines.append(input_bound_advice(results["data_wait_frac"], threshold, workers))
        else:
            split = ", ".join(
                f"{name.replace('_', ' ')} {100 * results[f'{name}_frac']:.0f}%"
                for name in PHASES
                if f"{name}_frac" in results
            )
            lines.append(f"step time: {split}; peak memory {results['peak_mem_gb']:.2f} GB")
    return lines
