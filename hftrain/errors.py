"""The one exception type a user should ever see from hftrain.

An ``HftrainError`` is a problem the user can fix (a bad recipe key, a missing file, a malformed line).
The CLI prints its message alone, without a traceback, and exits with status 2. Anything else that
escapes is a bug in hftrain and keeps its traceback.

This module is also the one boundary where exceptions a user can fix become hftrain's one-line error.

The CLI (and a push's retry loop) pass whatever escaped to ``as_user_error``: a missing or unwritable file,
S3 without credentials, an endpoint that refuses or never answers, a 401 from the Hub. It returns the
HftrainError that names the file or URL and says what to do, or None for a bug in hftrain (which keeps its
traceback). Client libraries are recognised by class name, so nothing here imports them.
"""

from __future__ import annotations

import errno
from urllib.parse import urlsplit


class HftrainError(Exception):
    """A user-fixable problem; ``str(err)`` is the complete message."""


class Stopped(HftrainError):
    """Training stopped for a reason outside the recipe; running the same command again continues it. The CLI
    exits with `exit_code` (not 2: a restart, --max-restarts or a scheduler's requeue, can succeed)."""

    exit_code = 1


class NotShared(HftrainError):
    """Training finished and its model is saved, but sending it (or its metrics) to an outside service failed: the
    message has one line per service with the command that sends it later. The CLI exits with `exit_code`; a restart
    would train nothing more (--max-restarts does not restart it)."""

    exit_code = 76  # EX_PROTOCOL: a remote service failed


class Preempted(Stopped):
    """Training stopped on a preemption signal after saving a checkpoint; running again continues it."""

    exit_code = 75  # EX_TEMPFAIL, what the SLURM template requeues on


class Terminated(Stopped):
    """A command stopped by SIGTERM (a scheduler's cancel, `kill`) after ending what it started; it exits as a
    process killed by the signal does (128 + 15), so the scheduler sees the reason."""

    exit_code = 143


class PeerLost(Stopped):
    """Another process of the run (another node) stopped answering during training (parallel/liveness.py)."""

    exit_code = 76


# OSErrors about a path the user chose (a file, a directory, a file system), with what to do about each.
_OS_FIXES = {
    errno.ENOENT: "check the path",
    errno.EACCES: "fix the permissions or choose a path you can write",
    errno.EPERM: "fix the permissions or choose a path you can write",
    errno.EROFS: "choose a path on a writable file system",
    errno.EEXIST: "a file is in the way of a directory; move it or choose another path",
    errno.ENOTDIR: "a file is in the way of a directory; move it or choose another path",
    errno.EISDIR: "give a file, not a directory",
    errno.ENOSPC: "free some space, then run the same command again",
    errno.EDQUOT: "free some space, then run the same command again",
}
_TIMEOUTS = {
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectTimeout",
    "ReadTimeout",
    "WriteTimeout",
    "PoolTimeout",
    "TimeoutException",
    "FSTimeoutError",
    "TimeoutError",
    "ServerTimeoutError",
}
_REFUSED = {"EndpointConnectionError", "ConnectError", "ClientConnectorError", "ConnectionRefusedError"}


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen and len(seen) < 10:
        seen.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return seen


def _names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def _endpoint(err: BaseException) -> str:
    url = endpoint_of(err)
    if not url:
        return "the endpoint"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def as_user_error(err: BaseException, network_bound_s: float | None = None) -> HftrainError | None:
    """The user-facing error for `err` (or for an exception it was raised from), or None. `network_bound_s`:
    the bound a silent endpoint had (integrations.network.bound()), for the time-out message."""
    for cause in _chain(err):
        if isinstance(cause, HftrainError):
            return cause
        found = _explain(cause, network_bound_s)
        if found is not None:
            return found
    return None


def _explain(err: BaseException, bound_s: float | None) -> HftrainError | None:
    names = _names(err)
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return HftrainError(
            "S3: no credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run on a "
            "machine with an instance role); for a public bucket give storage_options {anon: true}."
        )
    if names & _TIMEOUTS:
        within = f"{bound_s:g} s, " if bound_s else ""
        return HftrainError(
            f"{_endpoint(err)}: no answer within the network time limit ({within}retries included). "
            "Check that the endpoint (AWS_ENDPOINT_URL, HF_ENDPOINT or storage_options.endpoint_url) is up, or raise "
            "faults.network_timeout_s."
        )
    if names & _REFUSED:
        return HftrainError(
            f"{_endpoint(err)}: cannot connect ({str(err).splitlines()[0][:160]}). Check the endpoint URL "
            "(AWS_ENDPOINT_URL, HF_ENDPOINT or storage_options.endpoint_url) and that the server is running."
        )
    status = getattr(getattr(err, "response", None), "status_code", None)
    if "HfHubHTTPError" in names and status in (401, 403):
        return HftrainError(
            f"{_endpoint(err)}: {status} {'Unauthorized' if status == 401 else 'Forbidden'}: the Hub refused the "
            "token. Set HF_TOKEN to a token with write access to the repository (or run `hf auth login`)."
        )
    if "HfHubHTTPError" in names and status is not None and 400 <= status < 500 and status not in (408, 429):
        reason = (getattr(err, "server_message", None) or str(err)).strip().replace("\n", " ")
        # not retried: it would refuse again
        return HftrainError(f"{_endpoint(err)}: {status}: the Hub refused the request: {reason[:600]}")
    if isinstance(err, OSError) and err.errno in _OS_FIXES and getattr(err, "filename", None):
        return HftrainError(f"{err.filename}: {err.strerror}; {_OS_FIXES[err.errno]}.")
    return None


def retryable(err: BaseException) -> bool:
    """Whether trying again can help: not for a refused token, missing credentials or a missing file."""
    found = as_user_error(err)
    if found is None:
        return True
    text = str(found)
    return "no answer within" in text or "cannot connect" in text


def endpoint_of(err: BaseException) -> str | None:
    """The URL a network error was about, when the client says (botocore's endpoint_url, httpx's request)."""
    kwargs = getattr(err, "kwargs", None)
    if isinstance(kwargs, dict) and kwargs.get("endpoint_url"):
        return str(kwargs["endpoint_url"])
    request = getattr(err, "_request", None) or getattr(getattr(err, "response", None), "request", None)
    url = getattr(request, "url", None)
    return str(url) if url is not None else None
