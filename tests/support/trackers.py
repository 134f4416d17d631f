"""Reading a run back from each experiment tracker's own local storage (what `training.report_to` wrote).

* trackio: the project's SQLite database under TRACKIO_DIR (table ``metrics``: one JSON object per step,
  keys prefixed ``train/`` and ``eval/``).
* Weights & Biases in offline mode: the run's ``.wandb`` file under WANDB_DIR, a LevelDB-style log of
  protobuf ``Record``s (wandb's own format: a 7-byte header, 32 KiB blocks, records of crc32 + length + type
  + data, split across blocks FIRST/MIDDLE/LAST). Read with wandb's own protobuf classes; history items
  carry the logged values as JSON.
* MLflow with a local file store: MlflowClient on the same tracking URI.

Each reader returns ``{metric name: [values in order]}`` with the trackers' prefixes removed (``eval_loss``
stays ``eval_loss``), so one assertion reads the same for all three.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections import defaultdict
from pathlib import Path

_WANDB_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tracker_env(root: Path) -> dict[str, str]:
    """Each tracker's local storage under `root`, nothing sent anywhere. MLflow >= 3.13 refuses a file store
    unless MLFLOW_ALLOW_FILE_STORE=true."""
    return {
        "TRACKIO_DIR": str(root / "trackio"),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root / "wandb"),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


def _unprefixed(key: str) -> str:
    """train/loss -> loss, eval/loss -> eval_loss (the Trainer's own names)."""
    if key.startswith("train/"):
        return key[len("train/") :]
    if key.startswith("eval/"):
        return "eval_" + key[len("eval/") :]
    return key


def trackio_metrics(trackio_dir: Path, project: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        for (metrics,) in db.execute("SELECT metrics FROM metrics ORDER BY id"):
            for key, value in json.loads(metrics).items():
                if isinstance(value, (int, float)):
                    out[_unprefixed(key)].append(float(value))
    return dict(out)


def wandb_records(path: Path) -> list[bytes]:
    """The records of a .wandb file (the LevelDB log format wandb writes)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", _WANDB_HEADER
    while pos + 7 <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # block trailer: padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
        elif kind == 0 and length == 0:
            break
    return records


def wandb_metrics(wandb_dir: Path) -> dict[str, list[float]]:
    from wandb.proto import wandb_internal_pb2

    (run_file,) = wandb_dir.rglob("run-*.wandb")
    out: dict[str, list[float]] = defaultdict(list)
    for raw in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            value = json.loads(item.value_json)
            if isinstance(value, (int, float)):
                out[_unprefixed(key)].append(float(value))
    return dict(out)


def mlflow_runs(tracking_uri: str) -> dict[str, dict[str, list[float]]]:
    """{run id: {metric: [values by step]}} of every run in the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            runs[run.info.run_id] = {
                key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                for key in run.data.metrics
            }
    return runs
