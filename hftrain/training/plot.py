"""The loss / grad-norm PNG written at the end of a run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(log_history: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"], e.get("grad_norm")) for e in log_history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if train:
        ax_loss.plot([s for s, _, _ in train], [v for _, v, _ in train], label="train loss")
        norms = [(s, g) for s, _, g in train if g is not None]
        ax_norm.plot([s for s, _ in norms], [g for _, g in norms], color="tab:orange", label="grad norm")
    if evals:
        ax_loss.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:green", label="validation loss")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_norm.set_ylabel("gradient norm")
    ax_norm.set_xlabel("optimizer step")
    ax_norm.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
