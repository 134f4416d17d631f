"""SageMaker against the local moto server of tests.support.s3: what moto received, and a job's container.

* ``recorded_requests(endpoint)`` records every request the moto server receives while the block runs, with
  moto's own recorder (``/moto-api/recorder/*``: the request as it arrived, headers and body), so a test
  asserts on the CreateTrainingJob request itself. moto's DescribeTrainingJob cannot show it: moto replaces
  the metric definitions with its own and does not keep the environment.
* ``job_environment(root)`` is what SageMaker sets up in a training container (directories under /opt/ml and
  the SM_* variables), under a temporary root instead of /opt/ml.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

ROLE_NAME = "hftrain-sagemaker-test"


@contextmanager
def recorded_requests(endpoint_url: str) -> Iterator[list[dict[str, Any]]]:
    """Yields a list that holds, once the block ends, every request moto received in it:
    {"method", "url", "target" (X-Amz-Target), "headers", "body" (bytes)}."""
    api = f"{endpoint_url}/moto-api/recorder"
    requests.post(f"{api}/reset-recording", timeout=10).raise_for_status()
    requests.post(f"{api}/start-recording", timeout=10).raise_for_status()
    seen: list[dict[str, Any]] = []
    try:
        yield seen
    finally:
        requests.post(f"{api}/stop-recording", timeout=10).raise_for_status()
        text = requests.get(f"{api}/download-recording", timeout=10).text
        requests.post(f"{api}/reset-recording", timeout=10).raise_for_status()
        for line in text.splitlines():
            entry = json.loads(line)
            body = entry.get("body") or ""
            body = base64.b64decode(body) if entry.get("body_encoded") else body.encode()
            seen.append(
                {
                    "method": entry["method"],
                    "url": entry["url"],
                    "headers": entry["headers"],
                    "body": body,
                    "target": entry["headers"].get("X-Amz-Target", ""),
                }
            )


def sagemaker_calls(requests_seen: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    """The JSON bodies of the SageMaker API calls named `action` (e.g. CreateTrainingJob)."""
    return [json.loads(r["body"]) for r in requests_seen if r["target"] == f"SageMaker.{action}"]


def make_role(iam: Any) -> str:
    """An execution role in moto's IAM (the SDK resolves a role name or ARN by reading it back)."""
    trust = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}
        ],
    }
    try:
        return iam.create_role(RoleName=ROLE_NAME, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    except iam.exceptions.EntityAlreadyExistsException:
        return iam.get_role(RoleName=ROLE_NAME)["Role"]["Arn"]


def job_environment(root: Path, hyperparameters: dict[str, str], channels: dict[str, Path]) -> dict[str, str]:
    """A training container's variables with /opt/ml under `root`; the checkpoint directory through
    HFTRAIN_SAGEMAKER_CHECKPOINTS, which the launcher also sets (to SageMaker's /opt/ml/checkpoints)."""
    ml = root / "opt" / "ml"
    for sub in ("model", "output/data", "checkpoints", "input/config"):
        (ml / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "SM_MODEL_DIR": str(ml / "model"),
        "SM_OUTPUT_DATA_DIR": str(ml / "output" / "data"),
        "SM_HPS": json.dumps(hyperparameters),
        "SM_TRAINING_ENV": json.dumps(
            {"hyperparameters": hyperparameters, "current_host": "algo-1", "hosts": ["algo-1"]}
        ),
        "SM_CURRENT_HOST": "algo-1",
        "SM_HOSTS": json.dumps(["algo-1"]),
        "HFTRAIN_SAGEMAKER_CHECKPOINTS": str(ml / "checkpoints"),
    }
    for name, path in channels.items():
        env[f"SM_CHANNEL_{name.upper()}"] = str(path)
    return env
