"""Connect and read timeouts for every network client hftrain drives, so a silent endpoint (one that accepts the
connection and never answers) is an error naming it within a bound, retries included, never a hang.

The bound is ``faults.network_timeout_s`` (default ``DEFAULT_BOUND_S`` = 60 s): ``configure`` applies it to

* fsspec's defaults for s3:// (s3fs/aiobotocore: connect and read timeouts sized for s3fs's and botocore's retries
  together), gs:// (gcsfs: a time limit per request) and http(s):// (aiohttp: connect and read time limits).
  Options a recipe gives in
  ``storage_options`` win; ``storage_options_with_timeouts`` merges the timeouts into them key by key;
* huggingface_hub: its shared HTTP client (used by create_repo, upload_folder, ...; unbounded by default) and
  the metadata and download timeouts (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT, inherited by child processes),
  through ``_compat.hub_request_timeouts``;
* the trackers' clients, through their documented variables where the user has not set them: MLflow's HTTP
  requests (MLFLOW_HTTP_REQUEST_TIMEOUT, _MAX_RETRIES, _BACKOFF_FACTOR; by default 120 s and 7 retries, minutes
  before a server that is down becomes an error) and W&B's start (WANDB_INIT_TIMEOUT, 90 s by default).

hftrain's own retries of a push (hub.py) stop once the bound is spent.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from hftrain import _compat

T = TypeVar("T")

DEFAULT_BOUND_S = 60.0
S3FS_ATTEMPTS = 5  # s3fs.S3FileSystem.retries: its own loop re-sends a request that timed out reading
BOTOCORE_ATTEMPTS = 2  # botocore's attempts per request (a 500, a reset, a time-out), inside each s3fs attempt
ATTEMPT_SHARE = 0.2  # the Hub client's per-request timeout; hub.py's retries stop at the bound

_bound = DEFAULT_BOUND_S
_configured = False
_set_here: set[str] = set()  # the environment variables configure set (a user's own are never changed)


def bound() -> float:
    """The time in seconds within which a silent endpoint becomes an error (faults.network_timeout_s)."""
    return _bound


def attempt_timeout() -> float:
    """The connect (and the read) timeout of one attempt."""
    return max(0.5, _bound * ATTEMPT_SHARE)


def s3_options() -> dict[str, Any]:
    """s3fs.S3FileSystem keyword arguments that bound every request, retries included: s3fs tries a request that
    timed out S3FS_ATTEMPTS times (~2 s of back-off in all), botocore BOTOCORE_ATTEMPTS times inside each (~1 s of
    back-off each); so a read time-out of bound / 14 leaves a silent endpoint at most ~0.85 of the bound. A refused
    or unanswered connection is not retried by s3fs: 2 x bound / 8."""
    return {
        "config_kwargs": {
            "connect_timeout": max(0.5, _bound / 8),
            "read_timeout": max(0.5, _bound / (S3FS_ATTEMPTS * BOTOCORE_ATTEMPTS + 4)),
            "retries": {"total_max_attempts": BOTOCORE_ATTEMPTS, "mode": "standard"},
        }
    }


def gcs_options() -> dict[str, Any]:
    """gcsfs.GCSFileSystem keyword arguments: a total time limit per request (a time-out is not retried)."""
    return {"requests_timeout": max(1.0, _bound * 0.5)}


def http_options() -> dict[str, Any]:
    """fsspec's HTTPFileSystem keyword arguments: aiohttp's per-connection and per-read time limits (fsspec does
    not retry a request that timed out; hftrain's transient-read retries, sources.py, stop at the bound)."""
    import aiohttp

    per = max(0.5, _bound * ATTEMPT_SHARE)
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=per, sock_read=per)}}


OPTIONS_BY_SCHEME = {
    "s3": s3_options,
    "s3a": s3_options,
    "gs": gcs_options,
    "gcs": gcs_options,
    "http": http_options,
    "https": http_options,
}
"""The network protocols whose clients hftrain bounds (hf:// goes through huggingface_hub, bounded below). Other
fsspec protocols (ftp, sftp, abfs, ...) keep their own defaults: docs/operations.md says so."""


def storage_options_with_timeouts(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` (a recipe's storage_options) with the timeouts for `url`'s scheme merged in; the recipe's own
    values win, key by key (config_kwargs and client_kwargs too)."""
    options = dict(options or {})
    scheme = url.split("://", 1)[0] if "://" in url else ""
    defaults = OPTIONS_BY_SCHEME[scheme]() if scheme in OPTIONS_BY_SCHEME else {}
    for key, value in defaults.items():
        if isinstance(value, dict) and isinstance(options.get(key), dict):
            options[key] = {**value, **options[key]}
        else:
            options.setdefault(key, value)
    return options


def configure(bound_s: float | None = None) -> None:
    """Apply the bound (None: the default) to fsspec's s3/gs defaults and to huggingface_hub, in this process
    and, through the environment, its children."""
    global _bound, _configured
    wanted = float(bound_s) if bound_s else DEFAULT_BOUND_S
    if _configured and wanted == _bound:
        return  # the Hub client in use (a push in flight) is kept
    _bound, _configured = wanted, True
    import fsspec.config

    fsspec.config.conf["s3"] = s3_options()
    fsspec.config.conf["gcs"] = fsspec.config.conf["gs"] = gcs_options()
    fsspec.config.conf["http"] = fsspec.config.conf["https"] = http_options()
    per = str(max(1, int(attempt_timeout())))
    os.environ["HF_HUB_ETAG_TIMEOUT"] = os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = per
    _compat.hub_request_timeouts(attempt_timeout())
    retries = 2  # with back-off 1 s, 2 s: three attempts of `per` seconds stay within the bound
    for key, value in {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": per,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "WANDB_INIT_TIMEOUT": str(max(1, int(_bound))),
    }.items():
        if key not in os.environ or key in _set_here:
            os.environ[key] = value
            _set_here.add(key)


def within_bound(action: Callable[[], T], what: str) -> T:
    """`action()` as a whole within the bound, for an operation made of several requests: the clients bound each
    request (retries included), not an operation of many; s3fs's makedirs alone is 3-4 requests, so a silent
    endpoint held it about 4 bounds. Past the bound, an HftrainError naming `what`; the action ends in the
    background (a daemon thread; each of its requests bounded). For a first contact: a large upload that goes on
    answering is not cut short."""
    import threading

    from hftrain.errors import HftrainError

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = action()
        except BaseException as err:  # handed to the caller
            box["error"] = err

    worker = threading.Thread(target=run, name="hftrain-bounded", daemon=True)
    worker.start()
    worker.join(_bound)
    if worker.is_alive():
        raise HftrainError(f"{what}: no answer within {_bound:g} s (faults.network_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


# URL schemes whose fsspec backend is an optional extra: scheme -> (module, store, extra)
OPTIONAL_BACKENDS = {"gs": ("gcsfs", "Google Cloud Storage", "gcs"), "gcs": ("gcsfs", "Google Cloud Storage", "gcs")}


def require_backend(path: str, key: str) -> None:
    """Fail early, naming the recipe key or option, when a URL's storage library is an extra that is not installed
    (fsspec's own ImportError would surface later as a traceback, or from a worker as a listing failure). Called
    wherever a URL from a user is first opened: data sources, `data prepare --out`, a model copied to a URL."""
    import importlib.util

    scheme = path.split("://", 1)[0].lower() if "://" in path else ""
    if scheme not in OPTIONAL_BACKENDS:
        return
    module, store, extra = OPTIONAL_BACKENDS[scheme]
    if importlib.util.find_spec(module) is None:
        from hftrain.errors import HftrainError

        raise HftrainError(f"{key}: {path!r} is on {store}, which needs {module}: pip install 'hftrain[{extra}]'.")
    if module == "gcsfs":
        _compat.plain_gcs_filesystem()
