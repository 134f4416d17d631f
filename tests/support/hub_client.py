"""Pointing huggingface_hub / transformers at a LocalHub: in this process (`patch`) and in child processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import pytest

_ENV_TO_REMOVE = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_OIDC_RESOURCE",
    "HF_OIDC_ID_TOKEN",
    "HUGGINGFACE_CO_STAGING",
)


class ClientSetup:
    """Mixed into `LocalHub` (uses its `endpoint` and `token_path`): the client side of the emulator."""

    def patch(self, monkeypatch: pytest.MonkeyPatch, cache_dir: str | os.PathLike | None = None) -> None:
        """Point this process's `huggingface_hub` / `transformers` at the hub, undone by `monkeypatch`.

        Sets the environment (`HF_ENDPOINT`, `HF_HUB_OFFLINE=0`, `HF_HUB_DISABLE_XET=1`, telemetry off, no ambient
        token: `HF_TOKEN` unset and `HF_TOKEN_PATH` a missing file, `HF_HUB_CACHE` if `cache_dir`) and, because
        `huggingface_hub.constants` reads those variables once at import time, also patches the derived module
        attributes: `constants.ENDPOINT`, `HUGGINGFACE_CO_URL_TEMPLATE`, `HF_URL_HOSTS`, `HF_HUB_OFFLINE` (what
        `is_offline_mode()` returns, so also for transformers), `HF_HUB_DISABLE_XET`, `HF_HUB_DISABLE_TELEMETRY`,
        `HF_TOKEN_PATH`, `HF_HUB_CACHE`; the endpoint of the module-level `HfApi` behind
        `huggingface_hub.create_repo` & co.; the trusted origins of `utils._http`; and transformers' cached `HfApi`.
        """
        import huggingface_hub.hf_api as hf_api_module
        import huggingface_hub.utils._http as http_module
        from huggingface_hub import constants

        env = self.subprocess_env(cache_dir=cache_dir, base={})
        for name in _ENV_TO_REMOVE:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

        endpoint = self.endpoint
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_URL_HOSTS", frozenset(constants.HF_URL_HOSTS | {"127.0.0.1"}))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", self.token_path)
        if cache_dir is not None:
            monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
        monkeypatch.setattr(hf_api_module.api, "endpoint", endpoint)
        if hasattr(http_module, "_HUB_ORIGINS"):
            origin = http_module._url_origin(endpoint)
            monkeypatch.setattr(http_module, "_HUB_ORIGINS", frozenset(http_module._HUB_ORIGINS | {origin}))
        # transformers keeps one HfApi (made with the endpoint of the time) in `transformers.utils.hub._hf_api`.
        transformers_hub = sys.modules.get("transformers.utils.hub")
        if transformers_hub is not None and hasattr(transformers_hub, "_hf_api"):
            monkeypatch.setattr(transformers_hub, "_hf_api", None)

    def forget_client_caches(self) -> None:
        """Drop transformers' cached HfApi if it points at this hub (it may have been made after `patch`)."""
        transformers_hub = sys.modules.get("transformers.utils.hub")
        cached = getattr(transformers_hub, "_hf_api", None)
        if cached is not None and getattr(cached, "endpoint", None) == self.endpoint:
            transformers_hub._hf_api = None  # type: ignore[union-attr]

    def subprocess_env(
        self,
        *,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        base: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """Environment for a child process (e.g. `python -c ...`) that should talk to this hub.

        Starts from `base` (default: `os.environ`), removes offline switches and ambient tokens, and sets
        `HF_ENDPOINT`, `HF_HUB_OFFLINE=0`, `HF_HUB_DISABLE_XET=1`, `HF_HUB_DISABLE_TELEMETRY=1`,
        `HF_TOKEN_PATH` (a missing file), plus `HF_TOKEN` if `token` and `HF_HUB_CACHE` if `cache_dir`.
        """
        env = dict(os.environ if base is None else base)
        for name in _ENV_TO_REMOVE:
            env.pop(name, None)
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HUB_OFFLINE="0",
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_TOKEN_PATH=self.token_path,
        )
        if token is not None:
            env["HF_TOKEN"] = token
        if cache_dir is not None:
            env["HF_HUB_CACHE"] = str(cache_dir)
        return env
