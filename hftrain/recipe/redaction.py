"""What never leaves the process: secrets in saved recipes, logs, model cards, trackers and error messages. A
secret-looking key's value, every storage option that is not a known setting, and the user info of any URL are
replaced by ***. Without the schema, so an error message is redacted before anything heavy is imported."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Keys whose values never leave the process: redacted in saved recipes, logs and error messages.
SECRET_KEY = re.compile(
    r"(?:^|_)(token|secret|password|passwd|api_key|secret_key|secret_access_key|private_key|credentials?)$", re.I
)


STORAGE_SETTINGS = frozenset(
    {
        "anon",
        "endpoint_url",
        "region_name",
        "requester_pays",
        "use_ssl",
        "version_aware",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
        "config_kwargs",
        "client_kwargs",
        "s3",
        "retries",
        "connect_timeout",
        "read_timeout",
        "max_attempts",
        "total_max_attempts",
        "mode",
        "addressing_style",
        "signature_version",
        "max_pool_connections",
        "project",
        "requests_timeout",
        "timeout",
        "consistency",
        "use_listings_cache",
        "listings_expiry_time",
        "skip_instance_cache",
        "block_size",
        "cache_timeout",
    }
)
"""storage_options keys that are settings, not credentials: saved as given. Every other storage option (keys,
headers, tokens under any name, a provider's own credential fields) is saved as ***: what may be saved is decided
by what the field is, not by whether its name looks secret."""
USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")  # scheme://user:password@host


def redact_value(key: str, value: Any) -> Any:
    if SECRET_KEY.search(key) and value not in (None, "", False):
        return "***"
    return USERINFO.sub(r"\1***@", value) if isinstance(value, str) else value


def redacted(data: Any, key: str = "", in_storage: bool = False) -> Any:
    """A copy of a nested structure with every secret removed: a secret-looking key's value replaced by *** (whole,
    when it is a mapping or list: e.g. a service-account `token: {client_email, private_key_id, ...}`), every
    storage option that is not a known setting (STORAGE_SETTINGS), and the user info of any URL."""
    if (
        key
        and (SECRET_KEY.search(key) or (in_storage and key not in STORAGE_SETTINGS))
        and data not in (None, "", False, {}, [])
    ):
        return "***"
    if isinstance(data, Mapping):
        inside = in_storage or key == "storage_options"
        return {k: redacted(v, str(k), inside) for k, v in data.items()}
    if isinstance(data, list):
        return [redacted(v, key, in_storage) for v in data]
    return redact_value(key, data)
