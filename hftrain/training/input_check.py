"""Before step 1 of a GPU run: will the input keep up? The tokens/s one loader worker makes of the run's data here
(data/input_rate.py, about half a second of reading) against the tokens/s the GPU consumes as `hftrain plan` times
a step (FLOPs per token at GPU_MFU of the device's peak); one warning line when the GPU would wait for data more
than monitor.input_bound_threshold of each step. Not on CPUs: there the step is slow beside the input, and the
run's end says when it was input-bound anyway (step_metrics.input_bound_advice)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from hftrain.data.input_rate import MEASURE_S, input_warning, tokens_per_s
from hftrain.data.loader import ResumableLoader
from hftrain.planning.fit import GPU_MFU
from hftrain.training.step_metrics import MetricsOptions


def consumed_tokens_per_s(flops_per_token: float, peak_flops: float, mfu: float, checkpointing: bool) -> float:
    """Tokens/s one device trains at `mfu` of `peak_flops` (planning/fit.step_time, per token: gradient checkpointing
    recomputes the forward, 8/6 of the work)."""
    return peak_flops * mfu / (flops_per_token * (8 / 6 if checkpointing else 1.0))


class InputCheckCallback(TrainerCallback):
    """Says before step 1 when the GPU would wait for its data (rank 0 measures and says it)."""

    def __init__(self, options: MetricsOptions, mfu: float = GPU_MFU, seconds: float = MEASURE_S):
        self.options, self.mfu, self.seconds = options, mfu, seconds
        self.line: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        if (
            args.device.type != "cuda"
            or not state.is_world_process_zero
            or not isinstance(train_dataloader, ResumableLoader)
        ):
            return
        o, dataset = self.options, train_dataloader.dataset
        consumed = consumed_tokens_per_s(o.flops_per_token, o.peak_flops, self.mfu, bool(args.gradient_checkpointing))
        how = (
            f"{self.mfu:.0%} of its {o.peak_flops / 1e12:,.0f} TFLOP/s peak at {o.flops_per_token:.3g} FLOPs per "
            "token, as `hftrain plan` times a step"
        )
        per_worker = tokens_per_s(dataset.plan, dataset.tokenizer, dataset.layout.readers, self.seconds)
        pretokenized = dataset.plan.pretokenized
        self.line = input_warning(
            consumed, per_worker, args.dataloader_num_workers, o.input_bound_threshold, pretokenized, how
        )
        if self.line:
            print(f"hftrain: {self.line}", flush=True)
