"""The one boundary where exceptions a user can fix become hftrain's one-line error.

The CLI (and a push's retry loop) pass whatever escaped to ``as_user_error``: a missing or unwritable file,
S3 without credentials, an endpoint that refuses or never answers, a 401 from the Hub. It returns the
HftrainError that names the file or URL and says what to do, or None for a bug in hftrain (which keeps its
traceback). Client libraries are recognised by class name, so nothing here imports them.
"""

from __future__ import annotations

import errno
from urllib.parse import urlsplit

from . import network
from .errors import HftrainError

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
_TIMEOUTS = {"ConnectTimeoutError", "ReadTimeoutError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout",
             "TimeoutException", "FSTimeoutError", "TimeoutError", "ServerTimeoutError"}  # fmt: skip
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
    url = network.endpoint_of(err)
    if not url:
        return "the endpoint"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def as_user_error(err: BaseException) -> HftrainError | None:
    """The user-facing error for `err` (or for an exception it was raised from), or None."""
    for cause in _chain(err):
        if isinstance(cause, HftrainError):
            return cause
        found = _explain(cause)
        if found is not None:
            return found
    return None


def _explain(err: BaseException) -> HftrainError | None:
    names = _names(err)
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return HftrainError(
            "S3: no credentials found. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run on a "
            "machine with an instance role); for a public bucket give storage_options {anon: true}."
        )
    if names & _TIMEOUTS:
        return HftrainError(
            f"{_endpoint(err)}: no answer within the network time limit ({network.bound():g} s, retries included). "
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
            f"{_endpoint(err)}: {status} {'Unauthorized' if status == 401 else 'Forbidden'}: the Hub refused the token. "
            "Set HF_TOKEN to a token with write access to the repository (or run `hf auth login`)."
        )
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
