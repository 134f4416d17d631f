"""Every file and folder name in a run directory (``training.output_dir``), in one place.

Train, hub, report, parity, the notebook API and the tests all reach a run's files through ``RunLayout``,
so a name changes in one line. What a run directory holds::

    hftrain_run.json            which run owns the directory (model / tokenizer / data fingerprint)
    metrics.jsonl               every log line, one JSON object each
    results.json                the end-of-run numbers
    training_curves.png         loss / grad-norm / lr curves
    report.html                 `hftrain report`
    profile/                    torch.profiler traces (recipe section `profile`)
    batches/                    what each process trained on, per micro-batch (data.record_batches)
    tokenizer/                  a tokenizer trained by this run (tokenizer.train)
    checkpoint-N/               complete checkpoints (each holds hftrain_complete.json)
    final/                      the final model: a standard HF model directory (LoRA: + adapter/)
    .staging/                   saves in progress; removed at the next start
    .hftrain.lock               held by the launch that trains here now (output_lock.py)
    .hftrain.writers            flocked by each process of that launch that writes here (output_lock.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Files inside a checkpoint or final/ that make it explain itself.
COMPLETE_MARKER = "hftrain_complete.json"
RECIPE_FILE = "hftrain_recipe.yaml"
BASE_FILE = "hftrain_base.json"  # a LoRA adapter's exact base model
ADAPTER_DIR = "adapter"  # final/adapter: the trained LoRA adapter beside the merged model
TRAINER_STATE_FILE = "trainer_state.json"  # written by the Trainer

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def data_state_file(rank: int) -> str:
    """The data position of one process inside a checkpoint."""
    return f"hftrain_data_state-rank{rank}.json"


DATA_STATE_GLOB = data_state_file(0).replace("0", "*")  # every process's data position in a checkpoint


def checkpoint_step(path: Path) -> int | None:
    """N for a directory named checkpoint-N, else None."""
    match = _CHECKPOINT.match(path.name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class RunLayout:
    root: Path

    RUN_FILE = "hftrain_run.json"
    METRICS_FILE = "metrics.jsonl"
    RESULTS_FILE = "results.json"
    PLOT_FILE = "training_curves.png"
    REPORT_FILE = "report.html"
    PROFILE_DIR = "profile"
    TOKENIZER_DIR = "tokenizer"
    FINAL = "final"
    INITIAL = "initial"  # the weights before step 1, when recipe.checkpoints keeps step 0 (Pythia's step0)
    STAGING = ".staging"
    OUTBOX = ".hftrain-outbox"  # the uploads the run still owes: staged copies and their journal (outbox.py)

    @property
    def run_file(self) -> Path:
        return self.root / self.RUN_FILE

    @property
    def metrics(self) -> Path:
        return self.root / self.METRICS_FILE

    @property
    def results(self) -> Path:
        return self.root / self.RESULTS_FILE

    @property
    def plot(self) -> Path:
        return self.root / self.PLOT_FILE

    @property
    def report(self) -> Path:
        return self.root / self.REPORT_FILE

    @property
    def profile(self) -> Path:
        return self.root / self.PROFILE_DIR

    @property
    def batches(self) -> Path:
        return self.root / "batches"

    @property
    def tokenizer(self) -> Path:
        return self.root / self.TOKENIZER_DIR

    @property
    def final(self) -> Path:
        return self.root / self.FINAL

    @property
    def initial(self) -> Path:
        return self.root / self.INITIAL

    @property
    def staging(self) -> Path:
        return self.root / self.STAGING

    @property
    def outbox(self) -> Path:
        return self.root / self.OUTBOX

    def checkpoint(self, step: int) -> Path:
        return self.root / f"checkpoint-{step}"

    def staged(self, name: str) -> Path:
        """Where a checkpoint (or final/) is written before it is complete."""
        return self.staging / name

    def final_recipe(self) -> Path:
        return self.final / RECIPE_FILE
