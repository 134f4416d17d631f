"""A CPU training run at a 4 x 128, 64-token shape that prints the median of its minor page faults per step over
steps 16-35 (a median: a one-off growth of the heap, e.g. for a new data window, is not what this looks for; a
process that gives its buffers back to the kernel faults them in again at every step).

    python fault_count_run.py ROOT OUT with|without

"without" leaves glibc's malloc thresholds as the process's history set them (tests/test_cpu_memory.py)."""

import resource
import statistics
import sys
from pathlib import Path

ROOT, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
sys.path.insert(0, str(ROOT))

from transformers import TrainerCallback  # noqa: E402

import hftrain  # noqa: E402
from hftrain import _compat  # noqa: E402
from tests.support.data import make_documents, tiny_recipe, write_jsonl  # noqa: E402

if mode == "without":
    _compat.keep_freed_memory = lambda device: None


class Faults(TrainerCallback):
    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.last = 0

    def on_step_end(self, args, state, control, **kwargs):
        now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if 16 <= state.global_step <= 35:
            self.per_step.append(now - self.last)
        self.last = now


raw = tiny_recipe(
    write_jsonl(out / "train.jsonl", make_documents(600)),
    out / "run",
    max_steps=36,
    per_device_train_batch_size=12,
    logging_steps=12,
    save_steps=1000,
)
raw["model"] = {
    "preset": "cpu-small",
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "intermediate_size": 512,
}
raw["data"]["seq_len"] = 64
raw["monitor"]["sample_max_new_tokens"] = 0
faults = Faults()
hftrain.train(hftrain.load_recipe(None, raw), callbacks=[faults])
print("FAULTS_PER_STEP", statistics.median(faults.per_step), "each:", *faults.per_step)
