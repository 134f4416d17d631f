"""Inside a SageMaker training job: hftrain follows SageMaker's conventions with no change to the recipe.

A job is recognised by the variables SageMaker sets in its containers (``SM_MODEL_DIR``, ``SM_TRAINING_ENV``).
Then, for ``hftrain train``:

* the run directory (``training.output_dir``) is the job's checkpoint directory, ``/opt/ml/checkpoints``
  (``HFTRAIN_SAGEMAKER_CHECKPOINTS`` overrides it), which SageMaker syncs to the job's ``checkpoint_s3_uri``
  and restores before a restarted (spot) job starts, so the run resumes where it stopped;
* the final model (``final/``) is copied to ``SM_MODEL_DIR`` (/opt/ml/model), which SageMaker packs into
  model.tar.gz, and results.json, metrics.jsonl and hftrain_run.json to ``SM_OUTPUT_DATA_DIR`` (output.tar.gz);
* a data path ``channel:NAME`` or ``channel:NAME/sub/path`` is the input channel NAME (``SM_CHANNEL_NAME``);
* every log line is also printed as ``hftrain-metrics step=N key=value ...``, which the metric definitions
  of the launcher (sagemaker.py: METRIC_DEFINITIONS) capture into CloudWatch and the job's description.

Every directory comes from its environment variable, so a test can stand a job up in a temporary root.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hftrain.checkpoint.layout import RunLayout
from hftrain.errors import HftrainError

DEFAULT_CHECKPOINTS = "/opt/ml/checkpoints"
CHECKPOINTS_VAR = "HFTRAIN_SAGEMAKER_CHECKPOINTS"
CHANNEL = "channel:"
METRICS_PREFIX = "hftrain-metrics"


@dataclass(frozen=True)
class Job:
    """The SageMaker directories of this container."""

    checkpoints: Path
    model_dir: Path
    output_data_dir: Path | None
    channels: dict[str, Path] = field(default_factory=dict)

    def channel_path(self, path: str) -> str:
        """`channel:NAME[/rest]` -> the channel's local directory (+ rest)."""
        name, _, rest = path[len(CHANNEL) :].partition("/")
        if name not in self.channels:
            known = ", ".join(sorted(self.channels)) or "none"
            raise HftrainError(f"data path {path!r}: this job has no input channel {name!r} (its channels: {known}).")
        return str(self.channels[name] / rest) if rest else str(self.channels[name])


def current_job(environ: Any = None) -> Job | None:
    """The job this process runs in, or None outside SageMaker."""
    env = os.environ if environ is None else environ
    if not (env.get("SM_MODEL_DIR") or env.get("SM_TRAINING_ENV")):
        return None
    channels = {
        key[len("SM_CHANNEL_") :].lower(): Path(value) for key, value in env.items() if key.startswith("SM_CHANNEL_")
    }
    output = env.get("SM_OUTPUT_DATA_DIR")
    return Job(
        checkpoints=Path(env.get(CHECKPOINTS_VAR) or DEFAULT_CHECKPOINTS),
        model_dir=Path(env.get("SM_MODEL_DIR") or "/opt/ml/model"),
        output_data_dir=Path(output) if output else None,
        channels=channels,
    )


def _sources(data: dict[str, Any]) -> list[dict[str, Any]]:
    train = data.get("train") or []
    return [*(train if isinstance(train, list) else [train]), *([data["validation"]] if data.get("validation") else [])]


def in_job(raw: dict[str, Any], job: Job | None) -> dict[str, Any] | None:
    """The recipe's values (recipe_to_dict, unredacted) as they run in `job`: output_dir in the checkpoint
    directory, channel: paths resolved; None outside a job, where the recipe runs unchanged and a channel: path is
    an error that says so. The command that holds the recipe validates the result (cli/train.py)."""
    uses_channels = [
        s
        for s in _sources(raw["data"])
        for key in ("path", "pretokenized", "megatron")
        if str(s.get(key) or "").startswith(CHANNEL)
    ]
    if job is None:
        if uses_channels:
            raise HftrainError(
                "data: a channel:NAME path names a SageMaker input "
                "channel; it works only inside a SageMaker training job."
            )
        return None
    for source in _sources(raw["data"]):
        for key in ("path", "pretokenized", "megatron"):
            if str(source.get(key) or "").startswith(CHANNEL):
                source[key] = job.channel_path(source[key])
    raw["training"]["output_dir"] = str(job.checkpoints)
    return raw


def deliver(run: Any, job: Job) -> list[Path]:
    """Copy the final model to SM_MODEL_DIR and the run's records to SM_OUTPUT_DATA_DIR (main process only)."""
    if run.trainer.args.process_index != 0 or not Path(run.final_dir).is_dir():
        return []
    job.model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run.final_dir, job.model_dir, dirs_exist_ok=True)
    written = [job.model_dir]
    if job.output_data_dir is not None:
        layout = RunLayout(Path(run.output_dir))
        job.output_data_dir.mkdir(parents=True, exist_ok=True)
        for path in (layout.results, layout.metrics, layout.run_file):
            if path.is_file():
                shutil.copy2(path, job.output_data_dir / path.name)
                written.append(job.output_data_dir / path.name)
    print(f"hftrain: final model copied to {job.model_dir} (SageMaker uploads it as model.tar.gz)", flush=True)
    return written


def metrics_line(step: int, logs: dict[str, Any]) -> str | None:
    """`hftrain-metrics step=N key=value ...` for the numeric values of one log line."""
    pairs = [
        f"{key}={float(value):.6g}"
        for key, value in logs.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ]
    return f"{METRICS_PREFIX} step={step} {' '.join(pairs)}" if pairs else None


def metric_lines_callback() -> Any:
    """A TrainerCallback that prints each log line as a metrics line on the main process, for SageMaker's metric
    definitions. Made here, not at import: `hftrain train` reads this module before the recipe is checked, and a
    recipe wrong on its face is refused without importing transformers (issue 54 part 7)."""
    from transformers import TrainerCallback

    class MetricLinesCallback(TrainerCallback):
        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
        ) -> None:
            line = metrics_line(state.global_step, logs or {}) if state.is_world_process_zero else None
            if line:
                print(line, flush=True)

    return MetricLinesCallback()


def hyperparameter_overrides(environ: Any = None) -> list[str]:
    """The job's hyperparameters (SM_HPS, set by SageMaker from the launcher's) as `key=value` overrides."""
    env = os.environ if environ is None else environ
    try:
        hps = json.loads(env.get("SM_HPS") or "{}")
    except json.JSONDecodeError as err:
        raise HftrainError(f"SM_HPS is not JSON ({err}).") from None
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in hps.items()]
