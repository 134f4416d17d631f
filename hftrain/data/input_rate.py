"""Whether the input keeps up with the device: the tokens/s one loader worker makes of the run's data on this
machine, measured in a moment before step 1, against the tokens/s the device consumes.

A GPU outruns a data pipeline that a CPU never notices: on an H200, pythia-160m consumed 267k tokens/s and, with
the loader in the training process, waited for data 5-6% of its steps (one window 31%). The measurement reads the
run's first reader as a worker would (tokenizing raw text, or reading a token folder), without the shuffle window
(the same work per token, without the wait to fill it), for about half a second after its first block (opening the
source is start-up, not throughput). The decision is pure: tests give it the numbers.
"""

from __future__ import annotations

import math
import time
from typing import Any

from hftrain.data.loader import DataPlan, train_blocks
from hftrain.data.stream import Worker

MEASURE_S = 0.5  # seconds of reading after the first block


def tokens_per_s(plan: DataPlan, tokenizer: Any, readers: int, seconds: float = MEASURE_S) -> float:
    """Tokens/s of one reader's blocks, read in this process (a DataLoader worker does the same work)."""
    stream = train_blocks(plan, tokenizer, Worker(index=0, count=readers), window=1)
    blocks = stream.blocks(stream.fresh_state())
    if next(blocks, None) is None:
        return float("inf")  # nothing to read: the loader will say so
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and next(blocks, None) is not None:
        count += 1
    return count * plan.section.seq_len / max(time.perf_counter() - start, 1e-9)


def wait_share(consumed: float, per_worker: float, workers: int) -> float:
    """The share of each step the device would wait for data, consuming `consumed` tokens/s from a loader whose
    workers make `per_worker` tokens/s each. No workers: the training process makes the data between steps, so
    each step waits for its own tokens (consumed / (per_worker + consumed)). Workers make it while the device
    computes: it waits only for what they cannot make in time."""
    if workers == 0:
        return consumed / (per_worker + consumed)
    return max(0.0, 1.0 - workers * per_worker / consumed)


def input_warning(
    consumed: float, per_worker: float, workers: int, threshold: float, pretokenized: bool, how: str
) -> str | None:
    """The line `train` prints before step 1 when the device would wait for data more than `threshold` of each step
    (monitor.input_bound_threshold, the share at which the run's end calls it input-bound); None when it keeps up.
    `how`: where the consumption comes from."""
    share = wait_share(consumed, per_worker, workers)
    if share <= threshold:
        return None
    what = "a token folder" if pretokenized else "raw text, tokenized as it is read"
    needed = math.ceil((1 - threshold) * consumed / per_worker)  # the fewest workers that wait at most `threshold`
    fixes = f"raise training.dataloader_num_workers (now {workers}; {needed} would keep up)"
    if not pretokenized:
        fixes += ", or tokenize the data once with `hftrain data prepare` (then data.train: [{pretokenized: DIR}])"
    return (
        f"warning: the input may not keep up: the device consumes about {consumed:,.0f} tokens/s ({how}), and one "
        f"loader worker makes {per_worker:,.0f} tokens/s of this data here ({what}); with {workers} worker(s) about "
        f"{100 * share:.0f}% of each step would wait for data. To feed it, {fixes}."
    )
