"""A mistake gets hftrain's one line, not a library's traceback or a reason cut off: exit 2 through the CLI's own
entry point in this process, nothing written and nothing sent first."""

from __future__ import annotations

import sys

import pytest

from ..support.checks import tree_digest
from ..support.cli import in_process
from .conftest import fill

# (name, argv with conftest.fill's placeholders, the message, a module to hide as if not installed)
PLAIN = [
    (
        "prepare to gs:// without gcsfs",
        ["data", "prepare", "{recipe}", "--out", "gs://bucket/shards"],
        "--out: 'gs://bucket/shards' is on Google Cloud Storage, which needs gcsfs: pip install 'hftrain[gcs]'.",
        "gcsfs",
    ),
    (
        "push --revision with '..'",
        ["push", "{tmp}", "--repo-id", "me/model", "--revision", "exp..2"],
        "argument --revision: 'exp..2' is not a branch name (it contains '..')",
        None,
    ),
    (
        "push --revision with a space",
        ["push", "{tmp}", "--repo-id", "me/model", "--revision", "my run"],
        "argument --revision: 'my run' is not a branch name (it contains ' ')",
        None,
    ),
    (
        "push --revision ending .lock",
        ["push", "{tmp}", "--repo-id", "me/model", "--revision", "v1.lock"],
        "argument --revision: 'v1.lock' is not a branch name",
        None,
    ),
    (
        "push --report-to a misspelt tracker",
        ["push", "{tmp}", "--report-to", "mlfow"],
        "--report-to mlfow: mlfow is not supported, only azure_ml, comet_ml, mlflow,",
        None,
    ),
    (
        "push --report-to where no run is",
        ["push", "{notdir}", "--report-to", "tensorboard"],
        "{notdir}/metrics.jsonl not found: --report-to tensorboard "
        "sends a run's metrics.jsonl; give the run's directory",
        None,
    ),
    (
        "bf16 in a ZeRO-3 rehearsal on a CPU",
        ["train", "{recipe}", "--accelerate-config", "zero3", "training.bf16=true"],
        "training.bf16: true, but a ZeRO-3 rehearsal on CPU trains in fp32: TrainingArguments takes bf16 without a GPU "
        "only with use_cpu, which turns DeepSpeed off. Add training.bf16=false to the command line",
        None,
    ),
]


@pytest.mark.parametrize("name, argv, expected, hidden", PLAIN, ids=[c[0] for c in PLAIN])
def test_a_mistake_gets_one_line(capsys, monkeypatch, work, name, argv, expected, hidden):
    if hidden:
        monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed
    before = tree_digest(work)
    places = fill(work)
    code, printed = in_process(capsys, *(word.format(**places) for word in argv))
    assert code == 2 and "Traceback" not in printed and "ImportError" not in printed, (code, printed[-2000:])
    assert expected.format(**places) in printed, printed[-2000:]
    assert tree_digest(work) == before


def test_a_branch_name_the_hub_takes_passes():
    from hftrain.cli.push import branch_name

    for name in ("main", "step1000", "exp/lr-3e-4", "v1.0", "run_2"):
        assert branch_name(name) == name


def test_the_hubs_refusal_is_not_retried_and_keeps_its_reason():
    """A 4xx from the Hub (not a time-out or a rate limit) is final: said once, with the Hub's whole reason."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    from hftrain.errors import as_user_error, retryable

    reason = "Invalid rev id: exp..2. A branch name must not contain '..' (git check-ref-format); see the docs."
    request = httpx.Request("POST", "http://hub.example/api/models/me/model/branch/exp..2")
    response = httpx.Response(400, request=request, json={"error": reason}, headers={"X-Error-Message": reason})
    err = HfHubHTTPError(
        f"400 Client Error: Bad Request for url: {request.url}\n\n{reason}", response=response, server_message=reason
    )
    found = as_user_error(err)
    assert found is not None and not retryable(err)
    assert str(found).endswith(f"400: the Hub refused the request: {reason}"), str(found)
    for status in (408, 429, 500, 503):  # worth another try
        again = HfHubHTTPError(f"{status}", response=httpx.Response(status, request=request))
        assert retryable(again), status
