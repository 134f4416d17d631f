"""A local, in-memory stand-in for the Hugging Face Hub HTTP API, for tests that must not touch huggingface.co.

`LocalHub` runs a standard-library `ThreadingHTTPServer` on 127.0.0.1 (a free port) that answers the requests
the real `huggingface_hub` client (2.4.x) and `transformers` send for the following, so tests can drive it only
through those libraries:

* repos: `create_repo` (model and dataset repos, public or private, `exist_ok`), `delete_repo`,
  `update_repo_settings` (visibility), `repo_info` / `model_info` / `dataset_info` (also `files_metadata=True`),
  `repo_exists`, `revision_exists`, `whoami`;
* git-like history: each repo has branches and tags pointing at commits whose ids are sha1 hashes (a new repo gets
  an "initial commit" holding `.gitattributes`, as on the Hub); `create_branch` / `delete_branch` (a commit to a
  branch that does not exist is refused with `RevisionNotFoundError`, as on the Hub: create the branch first),
  `create_tag` / `delete_tag`, `list_repo_refs`, `list_repo_commits`;
* uploads: the preupload endpoint answers "regular" for every file (so `upload_folder`, `upload_file`,
  `create_commit` and `push_to_hub` send file contents base64-encoded inside the commit, whatever their size),
  unless `LocalHub(lfs_threshold=N)` is used: then files of N bytes or more are answered "lfs" and uploaded through
  the basic git-LFS batch protocol (single PUT, no multipart, no verify step) before the commit references them;
  additions, deletions of files and folders, `parent_commit` checks, and unchanged files skipped by the client
  (the preupload answer carries the remote oid);
* listings: `list_repo_files`, `list_repo_tree` (recursive or not, sub-folders), `get_paths_info`;
* downloads: HEAD and GET on `/{repo_id}/resolve/{revision}/{path}` (and `/datasets/...`) with the headers the
  client checks (`ETag`, `X-Repo-Commit`, `Content-Length`, `X-Linked-Etag` / `X-Linked-Size` for LFS files,
  `X-Error-Code` on errors, byte `Range` requests), so `hf_hub_download`, `snapshot_download`, `file_exists` and
  `AutoModel*/AutoTokenizer.from_pretrained(repo_id)` work over plain HTTP. Files are served directly (no redirect
  to a CDN) and no Xet headers are ever sent, so the client never takes the Xet path.
* auth: every `Authorization: Bearer <token>` received is recorded in `LocalHub.tokens_seen` (and each request in
  `LocalHub.requests`). Any token is accepted (optionally only those in `valid_tokens`; others get the Hub's
  401 "Invalid credentials in Authorization header"), and any accepted token may write to and read any repo: there
  are no users, organizations or permissions. Writes without a token get 401; private repos answer 401
  `RepoNotFound` to requests without a token, as the Hub does.

Not emulated: Xet storage, LFS multipart uploads and the LFS verify step, redirects to a CDN, pull requests and
`create_pr=True`, discussions, Spaces, kernels, buckets, collections, search / `list_models`, gated repos, user and
organization accounts and permissions, repo renaming / moving / duplication, cross-repo copies, squashing history,
webhooks, inference, the `expand=` selection of `repo_info` (all fields are always returned), `lastCommit` /
security info in tree listings, `.gitignore` handling in preupload, and YAML validation of README.md (always valid).
Repo ids must be `namespace/name`; `create_repo("name")` without a namespace uses `LocalHub.username`.

Endpoints ({t} is `models` or `datasets`, {repo} is `namespace/name`, {p} is `` or `datasets/`; anything else gets
a 404 and is listed in `LocalHub.unhandled`; an emulator bug gets a 500 and its traceback in `LocalHub.errors`):

    GET    /api/whoami-v2                          POST   /api/repos/create        DELETE /api/repos/delete
    POST   /api/validate-yaml                      *      /api/telemetry/...  (200, ignored)
    GET    /api/{t}/{repo}                         GET    /api/{t}/{repo}/revision/{rev}
    GET    /api/{t}/{repo}/tree/{rev}[/{path}]     POST   /api/{t}/{repo}/paths-info/{rev}
    GET    /api/{t}/{repo}/refs                    GET    /api/{t}/{repo}/commits/{rev}
    POST   /api/{t}/{repo}/preupload/{rev}         POST   /api/{t}/{repo}/commit/{rev}      (ndjson)
    POST   /api/{t}/{repo}/branch/{branch}         DELETE /api/{t}/{repo}/branch/{branch}
    POST   /api/{t}/{repo}/tag/{rev}               DELETE /api/{t}/{repo}/tag/{tag}
    PUT    /api/{t}/{repo}/settings
    HEAD   /{p}{repo}/resolve/{rev}/{path}         GET    /{p}{repo}/resolve/{rev}/{path}
    POST   /{p}{repo}.git/info/lfs/objects/batch   PUT    /__lfs/upload/{one-time key}   (only with lfs_threshold)

Storage is in memory (lost at `stop()`); listings are answered in one page (no `Link` pagination header).

Use the `local_hub` pytest fixture (it starts a hub and points the in-process client at it, see `LocalHub.patch`),
and `LocalHub.subprocess_env()` for child processes.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

__all__ = ["Blob", "Commit", "LocalHub", "Repo", "RequestRecord", "local_hub"]

REPO_TYPES = ("model", "dataset")
_URL_PREFIX = {"model": "", "dataset": "datasets/"}
_API_SEGMENT = {"models": "model", "datasets": "dataset"}
_REPO_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?$")
_COMMIT_ID = re.compile(r"^[0-9a-f]{40}$")

GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pth filter=lfs diff=lfs merge=lfs -text\n"
    b"*.ckpt filter=lfs diff=lfs merge=lfs -text\n"
    b"*.h5 filter=lfs diff=lfs merge=lfs -text\n"
    b"*.msgpack filter=lfs diff=lfs merge=lfs -text\n"
    b"*.onnx filter=lfs diff=lfs merge=lfs -text\n"
    b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"
    b"*.zip filter=lfs diff=lfs merge=lfs -text\n"
    b"*tfevents* filter=lfs diff=lfs merge=lfs -text\n"
)


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob holding `data` (what the Hub calls the oid / blob id of a regular file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _now() -> datetime:
    return datetime.now(timezone.utc)


# --------------------------------------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blob:
    """The content of one file in a commit. `lfs_sha256` is set when the file was committed as an LFS file."""

    data: bytes = field(repr=False)
    lfs_sha256: str | None = None

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def pointer(self) -> bytes | None:
        if self.lfs_sha256 is None:
            return None
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.lfs_sha256}\nsize {self.size}\n".encode()

    @property
    def oid(self) -> str:
        """Git blob id: of the content for a regular file, of the LFS pointer for an LFS file (as on the Hub)."""
        return git_blob_oid(self.pointer if self.lfs_sha256 is not None else self.data)  # type: ignore[arg-type]

    @property
    def etag(self) -> str:
        return self.lfs_sha256 or self.oid


@dataclass(frozen=True)
class Commit:
    id: str
    parents: tuple[str, ...]
    files: Mapping[str, Blob] = field(repr=False)
    title: str
    message: str
    author: str
    date: datetime


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: datetime
    uid: str
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict, repr=False)
    lfs_objects: dict[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def key(self) -> str:
        """`ns/name` for models, `datasets/ns/name` for datasets (the key in `LocalHub.repos`)."""
        return _URL_PREFIX[self.repo_type] + self.repo_id

    def resolve(self, revision: str | None = None) -> Commit | None:
        """The commit a branch, tag or commit id points to (None if unknown)."""
        revision = revision or "main"
        for prefix, refs in (("refs/heads/", self.branches), ("refs/tags/", self.tags)):
            if revision.startswith(prefix) and revision[len(prefix) :] in refs:
                return self.commits[refs[revision[len(prefix) :]]]
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        if revision in self.tags:
            return self.commits[self.tags[revision]]
        if _COMMIT_ID.fullmatch(revision) and revision in self.commits:
            return self.commits[revision]
        return None

    def _commit(self, revision: str | None) -> Commit:
        commit = self.resolve(revision)
        if commit is None:
            raise KeyError(f"{self.key}: unknown revision {revision!r}")
        return commit

    def files(self, revision: str | None = None) -> dict[str, bytes]:
        """{path: content} of every file at `revision` (default "main")."""
        return {path: blob.data for path, blob in self._commit(revision).files.items()}

    def read(self, path: str, revision: str | None = None) -> bytes:
        return self._commit(revision).files[path].data

    def history(self, revision: str | None = None) -> list[Commit]:
        """Commits reachable from `revision` following first parents, newest first."""
        out, commit = [], self._commit(revision)
        while True:
            out.append(commit)
            if not commit.parents:
                return out
            commit = self.commits[commit.parents[0]]


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    token: str | None
    status: int


# --------------------------------------------------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------------------------------------------------


class HubError(Exception):
    """An error answer: JSON {"error": message}, with the `X-Error-Code` / `X-Error-Message` headers the client reads."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, dict(headers or {})
        self.extra = dict(extra or {})  # more fields of the JSON body


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> _Response:
    return _Response(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


@dataclass
class _Request:
    method: str
    segments: list[str]  # path segments, each percent-decoded on its own (so %2F stays inside its segment)
    query: dict[str, list[str]]
    headers: Any
    body: bytes
    token: str | None

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"{}")
        except ValueError as e:
            raise HubError(400, f"Invalid JSON body: {e}") from None

    def flag(self, name: str) -> bool:
        return (self.query.get(name) or ["false"])[-1].lower() in ("1", "true", "yes")


class _Handler(BaseHTTPRequestHandler):
    server_version = "LocalHub/1.0"
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after stop()
    hub: LocalHub  # set on the subclass made by LocalHub.start()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def _read_body(self) -> bytes:
        # Always read the whole body before answering: closing while the client still sends would turn an HTTP
        # error (e.g. 401 on a large commit) into a connection reset on the client side.
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        hub = self.hub
        split = urlsplit(self.path)
        auth = self.headers.get("Authorization") or ""
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        body = self._read_body()
        request = _Request(
            method=method,
            segments=[unquote(s) for s in split.path.split("/")[1:]],
            query=parse_qs(split.query, keep_blank_values=True),
            headers=self.headers,
            body=body,
            token=token or None,
        )
        try:
            response = hub._handle(request)
        except HubError as e:
            response = _json({"error": e.message, **e.extra}, e.status, e.headers)
            response.headers["X-Error-Message"] = e.message.encode("ascii", "replace").decode()
            if e.code:
                response.headers["X-Error-Code"] = e.code
        except Exception:  # a bug in the emulator: answer 500 with the traceback, keep serving
            tb = traceback.format_exc()
            hub.errors.append(tb)
            response = _json({"error": f"LocalHub internal error:\n{tb}"}, 500)
        with hub._lock:
            hub.requests.append(RequestRecord(method, self.path, request.token, response.status))
        self.send_response(response.status)
        headers = {"Content-Length": str(len(response.body)), **response.headers}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(response.body)


# --------------------------------------------------------------------------------------------------------------------
# The hub
# --------------------------------------------------------------------------------------------------------------------


class LocalHub:
    """An in-memory Hugging Face Hub on 127.0.0.1; see the module docstring for what it emulates.

    Use as `with LocalHub() as hub: ...` or `hub.start()` / `hub.stop()`. `hub.endpoint` is the base URL to use as
    `HF_ENDPOINT`; `hub.tokens_seen` the set of bearer tokens received; `hub.repos` the repos by key (`ns/name` for
    models, `datasets/ns/name` for datasets); `hub.requests` one `RequestRecord` per request answered.
    """

    def __init__(
        self,
        *,
        username: str = "local-user",
        valid_tokens: set[str] | None = None,
        lfs_threshold: int | None = None,
    ) -> None:
        self.username = username
        self.valid_tokens = set(valid_tokens) if valid_tokens is not None else None
        self.lfs_threshold = lfs_threshold
        self.tokens_seen: set[str] = set()
        self.requests: list[RequestRecord] = []
        self.errors: list[str] = []  # tracebacks of emulator bugs (answered with 500)
        self.unhandled: list[str] = []  # "METHOD /path" of requests for endpoints that are not emulated
        self._repos: dict[tuple[str, str], Repo] = {}
        self._lfs_uploads: dict[str, tuple[tuple[str, str], str, int]] = {}
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._tmpdir: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> LocalHub:
        if self._server is not None:
            return self
        handler = type("LocalHubHandler", (_Handler,), {"hub": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        self._server = server
        self._tmpdir = tempfile.mkdtemp(prefix="localhub-")
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="LocalHub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("LocalHub is not running: call start() first")
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token_path(self) -> str:
        """A token file path that does not exist (so the client finds no saved token unless a test logs in)."""
        assert self._tmpdir is not None, "LocalHub is not running"
        return os.path.join(self._tmpdir, "token")

    # ---- introspection and seeding ---------------------------------------------------------------------------------

    @property
    def repos(self) -> dict[str, Repo]:
        with self._lock:
            return {repo.key: repo for repo in self._repos.values()}

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        with self._lock:
            return self._repos[(repo_type, repo_id)]

    def add_repo(self, repo_id: str, *, repo_type: str = "model", private: bool = False) -> Repo:
        """Create a repo directly (no HTTP), with its initial commit; returns the existing one if already there."""
        if repo_type not in REPO_TYPES:
            raise ValueError(f"repo_type must be one of {REPO_TYPES}")
        ns, _, name = repo_id.partition("/")
        if not (_REPO_NAME.fullmatch(ns) and _REPO_NAME.fullmatch(name)) or "--" in repo_id or ".." in repo_id:
            raise ValueError(f"Invalid repo id {repo_id!r}: expected 'namespace/name'")
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                return self._repos[(repo_type, repo_id)]
            repo = Repo(repo_type, repo_id, private, _now(), secrets.token_hex(12))
            first = self._make_commit(repo, None, {".gitattributes": Blob(GITATTRIBUTES)}, "initial commit", "", "system")
            repo.branches["main"] = first.id
            self._repos[(repo_type, repo_id)] = repo
            return repo

    def commit_files(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | os.PathLike],
        *,
        repo_type: str = "model",
        branch: str = "main",
        message: str = "Seed files",
        delete: tuple[str, ...] = (),
    ) -> str:
        """Commit files directly (no HTTP) on an existing branch: {path_in_repo: bytes | local path}; returns the id."""
        blobs = {}
        for path, content in files.items():
            data = content if isinstance(content, bytes) else Path(content).read_bytes()
            blobs[_check_path(path)] = Blob(data)
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            head = repo.commits[repo.branches[branch]]
            tree = {p: b for p, b in head.files.items() if p not in delete}
            tree.update(blobs)
            commit = self._make_commit(repo, head.id, tree, message, "", self.username)
            repo.branches[branch] = commit.id
            return commit.id

    # ---- client configuration --------------------------------------------------------------------------------------

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
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
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

    # ---- request handling ------------------------------------------------------------------------------------------

    def _handle(self, req: _Request) -> _Response:
        if req.token is not None:
            with self._lock:
                self.tokens_seen.add(req.token)
            if self.valid_tokens is not None and req.token not in self.valid_tokens:
                raise HubError(401, "Invalid credentials in Authorization header")
        segs = req.segments
        if segs and segs[0] == "api":
            return self._api(req, segs[1:])
        if segs[:2] == ["__lfs", "upload"] and len(segs) == 3 and req.method == "PUT":
            return self._lfs_put(req, segs[2])
        repo_type, rest = ("dataset", segs[1:]) if segs and segs[0] == "datasets" else ("model", segs)
        if len(rest) >= 4 and rest[2] == "resolve" and req.method in ("GET", "HEAD"):
            return self._resolve(req, repo_type, f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:]))
        if (
            len(rest) == 6
            and rest[1].endswith(".git")
            and rest[2:] == ["info", "lfs", "objects", "batch"]
            and req.method == "POST"
        ):
            return self._lfs_batch(req, repo_type, f"{rest[0]}/{rest[1][: -len('.git')]}")
        return self._not_emulated(req)

    def _not_emulated(self, req: _Request) -> _Response:
        path = "/" + "/".join(req.segments)
        with self._lock:
            self.unhandled.append(f"{req.method} {path}")
        raise HubError(404, f"LocalHub does not emulate {req.method} {path}")

    def _api(self, req: _Request, segs: list[str]) -> _Response:
        m = req.method
        if segs == ["whoami-v2"] and m == "GET":
            return self._whoami(req)
        if segs == ["repos", "create"] and m == "POST":
            return self._create_repo(req)
        if segs == ["repos", "delete"] and m == "DELETE":
            return self._delete_repo(req)
        if segs == ["validate-yaml"] and m == "POST":
            return _json({"errors": [], "warnings": []})
        if segs[:1] == ["telemetry"]:
            return _json({})
        if len(segs) >= 3 and segs[0] in _API_SEGMENT:
            repo_type, repo_id, rest = _API_SEGMENT[segs[0]], f"{segs[1]}/{segs[2]}", segs[3:]
            head, arg = (rest[0], "/".join(rest[1:])) if rest else ("", "")
            route = (m, head)
            if route == ("GET", "") and not rest:
                return self._info(req, repo_type, repo_id, None)
            if route == ("GET", "revision") and arg:
                return self._info(req, repo_type, repo_id, arg)
            if route == ("GET", "tree") and len(rest) >= 2:
                return self._tree(req, repo_type, repo_id, rest[1], "/".join(rest[2:]))
            if route == ("POST", "paths-info") and arg:
                return self._paths_info(req, repo_type, repo_id, arg)
            if route == ("GET", "refs") and len(rest) == 1:
                return self._refs(req, repo_type, repo_id)
            if route == ("GET", "commits") and arg:
                return self._commits(req, repo_type, repo_id, arg)
            if route == ("POST", "preupload") and arg:
                return self._preupload(req, repo_type, repo_id, arg)
            if route == ("POST", "commit") and arg:
                return self._commit(req, repo_type, repo_id, arg)
            if head == "branch" and arg and m in ("POST", "DELETE"):
                return self._branch(req, repo_type, repo_id, arg)
            if head == "tag" and arg and m in ("POST", "DELETE"):
                return self._tag(req, repo_type, repo_id, arg)
            if route == ("PUT", "settings") and len(rest) == 1:
                return self._settings(req, repo_type, repo_id)
        return self._not_emulated(req)

    # ---- helpers ---------------------------------------------------------------------------------------------------

    def _url(self, repo: Repo) -> str:
        return f"{self.endpoint}/{_URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    @staticmethod
    def _require_token(req: _Request) -> None:
        if req.token is None:
            raise HubError(401, "Unauthorized: this operation needs a token (Authorization: Bearer ...)")

    def _read_repo(self, req: _Request, repo_type: str, repo_id: str) -> Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and req.token is None):
            status = 401 if req.token is None else 404
            raise HubError(status, "Repository not found", code="RepoNotFound")
        return repo

    def _write_repo(self, req: _Request, repo_type: str, repo_id: str) -> Repo:
        self._require_token(req)
        return self._read_repo(req, repo_type, repo_id)

    @staticmethod
    def _resolve_rev(repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return commit

    @staticmethod
    def _branch_head(repo: Repo, revision: str) -> Commit:
        branch = revision[len("refs/heads/") :] if revision.startswith("refs/heads/") else revision
        if branch.startswith("refs/pr/"):
            raise HubError(400, "LocalHub does not emulate pull requests")
        if branch not in repo.branches:
            if repo.resolve(revision) is not None:
                raise HubError(400, f"Invalid rev id: {revision} is not a branch: commits go on branches")
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return repo.commits[repo.branches[branch]]

    def _make_commit(
        self, repo: Repo, parent: str | None, files: dict[str, Blob], title: str, message: str, author: str
    ) -> Commit:
        date = _now()
        tree = hashlib.sha1("".join(f"{p}\0{b.oid}\n" for p, b in sorted(files.items())).encode()).hexdigest()
        text = f"tree {tree}\n"
        text += f"parent {parent}\n" if parent else ""
        text += f"author {author} {date.timestamp():.6f} +0000\nx-localhub-seq {next(self._seq)}\n\n{title}\n\n{message}"
        raw = text.encode()
        commit_id = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
        commit = Commit(commit_id, (parent,) if parent else (), dict(files), title, message, author, date)
        repo.commits[commit_id] = commit
        return commit

    @staticmethod
    def _file_entry(path: str, blob: Blob) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": blob.oid, "size": blob.size, "path": path}
        if blob.lfs_sha256 is not None:
            entry["lfs"] = {"oid": blob.lfs_sha256, "size": blob.size, "pointerSize": len(blob.pointer or b"")}
        return entry

    @staticmethod
    def _dir_entry(path: str, files: Mapping[str, Blob]) -> dict[str, Any]:
        inside = sorted((p, b.oid) for p, b in files.items() if p.startswith(path + "/"))
        oid = hashlib.sha1("".join(f"{p}\0{o}\n" for p, o in inside).encode()).hexdigest()
        return {"type": "directory", "oid": oid, "size": 0, "path": path}

    # ---- endpoints -------------------------------------------------------------------------------------------------

    def _whoami(self, req: _Request) -> _Response:
        if req.token is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return _json(
            {
                "type": "user",
                "id": hashlib.sha1(self.username.encode()).hexdigest()[:24],
                "name": self.username,
                "fullname": self.username,
                "email": None,
                "emailVerified": False,
                "canPay": False,
                "isPro": False,
                "avatarUrl": "",
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "local-hub", "role": "write"}},
            }
        )

    def _create_repo(self, req: _Request) -> _Response:
        self._require_token(req)
        body = req.json()
        repo_type = body.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"LocalHub only emulates model and dataset repos, not {repo_type!r}")
        repo_id = f"{body.get('organization') or self.username}/{body.get('name')}"
        private = body.get("visibility") == "private" or body.get("private") is True
        with self._lock:
            existing = self._repos.get((repo_type, repo_id))
            if existing is not None:
                # The Hub's 409 carries the url too: `create_repo(..., exist_ok=True)` reads it.
                message = f"You already created this {repo_type} repo: {repo_id}"
                raise HubError(409, message, extra={"url": self._url(existing)})
            try:
                repo = self.add_repo(repo_id, repo_type=repo_type, private=private)
            except ValueError as e:
                raise HubError(400, str(e)) from None
        return _json({"url": self._url(repo), "name": repo_id, "id": repo.uid})

    def _delete_repo(self, req: _Request) -> _Response:
        self._require_token(req)
        body = req.json()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or self.username}/{body.get('name')}"
        with self._lock:
            self._write_repo(req, repo_type, repo_id)
            del self._repos[(repo_type, repo_id)]
        return _json({})

    def _settings(self, req: _Request, repo_type: str, repo_id: str) -> _Response:
        body = req.json()
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if "visibility" in body:
                repo.private = body["visibility"] == "private"
            elif "private" in body:
                repo.private = bool(body["private"])
        return _json({})

    def _info(self, req: _Request, repo_type: str, repo_id: str, revision: str | None) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            commit = self._resolve_rev(repo, revision or "main")
        blobs = req.flag("blobs")
        siblings = []
        for path, blob in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=blob.size, blobId=blob.oid)
                if blob.lfs_sha256 is not None:
                    sibling["lfs"] = {"size": blob.size, "sha256": blob.lfs_sha256, "pointerSize": len(blob.pointer or b"")}
            siblings.append(sibling)
        return _json(
            {
                "_id": repo.uid,
                "id": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit.id,
                "lastModified": _iso(commit.date),
                "createdAt": _iso(repo.created_at),
                "private": repo.private,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "usedStorage": sum(b.size for b in commit.files.values()),
            }
        )

    def _tree(self, req: _Request, repo_type: str, repo_id: str, revision: str, path: str) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            commit = self._resolve_rev(repo, revision)
        files, prefix = commit.files, path.strip("/")
        base = f"{prefix}/" if prefix else ""
        if prefix and not any(p.startswith(base) for p in files):
            raise HubError(404, f"Entry not found: {prefix}", code="EntryNotFound")
        recursive = req.flag("recursive")
        entries: dict[str, dict[str, Any]] = {}
        for p, blob in sorted(files.items()):
            if not p.startswith(base):
                continue
            parts = p[len(base) :].split("/")
            dirs = range(1, len(parts)) if recursive else range(1, min(len(parts), 2))
            for i in dirs:
                d = base + "/".join(parts[:i])
                entries.setdefault(d, self._dir_entry(d, files))
            if recursive or len(parts) == 1:
                entries[p] = self._file_entry(p, blob)
        return _json(list(entries.values()))

    def _paths_info(self, req: _Request, repo_type: str, repo_id: str, revision: str) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            commit = self._resolve_rev(repo, revision)
        form = parse_qs(req.body.decode(), keep_blank_values=True)
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit.files:
                out.append(self._file_entry(path, commit.files[path]))
            elif any(p.startswith(path + "/") for p in commit.files):
                out.append(self._dir_entry(path, commit.files))
        return _json(out)

    def _refs(self, req: _Request, repo_type: str, repo_id: str) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            branches = [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in sorted(repo.branches.items())]
            tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in sorted(repo.tags.items())]
        return _json({"branches": branches, "converts": [], "tags": tags, "pullRequests": []})

    def _commits(self, req: _Request, repo_type: str, repo_id: str, revision: str) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            self._resolve_rev(repo, revision)
            history = repo.history(revision)
        return _json(
            [
                {
                    "id": c.id,
                    "title": c.title,
                    "message": c.message,
                    "authors": [{"user": c.author, "avatar": ""}],
                    "date": _iso(c.date),
                }
                for c in history
            ]
        )

    def _preupload(self, req: _Request, repo_type: str, repo_id: str, revision: str) -> _Response:
        if req.flag("create_pr"):
            raise HubError(400, "LocalHub does not emulate pull requests (create_pr)")
        body = req.json()
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            head = self._branch_head(repo, revision)
        answers = []
        for item in body.get("files", []):
            path, size = item["path"], int(item.get("size", 0))
            lfs = self.lfs_threshold is not None and size > 0 and size >= self.lfs_threshold
            remote = head.files.get(path)
            if remote is None:
                oid = None
            elif lfs:
                oid = remote.lfs_sha256
            else:
                oid = remote.oid if remote.lfs_sha256 is None else None
            answers.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return _json({"files": answers, "commitOid": head.id})

    def _commit(self, req: _Request, repo_type: str, repo_id: str, revision: str) -> _Response:
        if req.flag("create_pr"):
            raise HubError(400, "LocalHub does not emulate pull requests (create_pr)")
        self._require_token(req)
        try:
            items = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        except ValueError as e:
            raise HubError(400, f"Invalid ndjson commit payload: {e}") from None
        header = next((i["value"] for i in items if i.get("key") == "header"), None)
        if header is None or not header.get("summary"):
            raise HubError(400, "Commit payload needs a header with a non-empty summary")
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            head = self._branch_head(repo, revision)
            parent = header.get("parentCommit")
            if parent and parent != head.id:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(head.files)
            for item in items:
                key, value = item.get("key"), item.get("value") or {}
                if key == "header":
                    continue
                if key in ("file", "lfsFile", "deletedFile", "deletedFolder"):
                    raw_path = value.get("path", "")
                    path = _check_path(raw_path.rstrip("/") if key == "deletedFolder" else raw_path, HubError)
                if key == "file":
                    content = value.get("content", "")
                    data = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                    tree[path] = Blob(data)
                elif key == "lfsFile":
                    oid = value.get("oid", "")
                    data = repo.lfs_objects.get(oid)
                    if data is None:
                        raise HubError(400, f"LFS object {oid} of {path} was not uploaded")
                    if "size" in value and int(value["size"]) != len(data):
                        raise HubError(400, f"LFS object {oid} of {path} has size {len(data)}, not {value['size']}")
                    tree[path] = Blob(data, lfs_sha256=oid)
                elif key == "deletedFile":
                    if tree.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                elif key == "deletedFolder":
                    inside = [p for p in tree if p.startswith(path + "/")]
                    if not inside:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                    for p in inside:
                        del tree[p]
                else:
                    raise HubError(400, f"LocalHub does not emulate commit operation {key!r}")
            branch = revision[len("refs/heads/") :] if revision.startswith("refs/heads/") else revision
            commit = self._make_commit(
                repo, head.id, tree, header["summary"], header.get("description") or "", self.username
            )
            repo.branches[branch] = commit.id
        return _json(
            {
                "success": True,
                "commitOid": commit.id,
                "commitUrl": f"{self._url(repo)}/commit/{commit.id}",
                "commitMessage": commit.title,
                "commitDescription": commit.message,
                "pullRequestUrl": None,
                "branch": branch,
            }
        )

    def _branch(self, req: _Request, repo_type: str, repo_id: str, branch: str) -> _Response:
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if req.method == "DELETE":
                if branch not in repo.branches:
                    raise HubError(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "You cannot delete the default branch")
                del repo.branches[branch]
                return _json({})
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            if branch.startswith("refs/") or not branch or ".." in branch:
                raise HubError(400, f"Invalid branch name: {branch}")
            start = self._resolve_rev(repo, req.json().get("startingPoint") or "main")
            repo.branches[branch] = start.id
        return _json({})

    def _tag(self, req: _Request, repo_type: str, repo_id: str, arg: str) -> _Response:
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if req.method == "DELETE":
                if repo.tags.pop(arg, None) is None:
                    raise HubError(404, f"Invalid rev id: {arg}", code="RevisionNotFound")
                return _json({})
            tag = req.json().get("tag") or ""
            if not tag:
                raise HubError(400, "Missing tag name")
            if tag in repo.tags:
                raise HubError(409, f"Tag already exists: {tag}")
            repo.tags[tag] = self._resolve_rev(repo, arg).id
        return _json({})

    def _resolve(self, req: _Request, repo_type: str, repo_id: str, revision: str, path: str) -> _Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            commit = self._resolve_rev(repo, revision)
        blob = commit.files.get(path)
        if blob is None:
            raise HubError(404, "Entry not found", code="EntryNotFound", headers={"X-Repo-Commit": commit.id})
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{blob.etag}"',
            "X-Repo-Commit": commit.id,
        }
        if blob.lfs_sha256 is not None:
            headers.update({"X-Linked-Etag": f'"{blob.lfs_sha256}"', "X-Linked-Size": str(blob.size)})
        data, status = blob.data, 200
        range_header = req.headers.get("Range")
        if range_header:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
            size = len(data)
            if match is None or match.group(1) == match.group(2) == "":
                raise HubError(416, f"Unsupported Range {range_header!r}", headers={"Content-Range": f"bytes */{size}"})
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            else:  # suffix range: the last N bytes
                start, end = max(size - int(match.group(2)), 0), size - 1
            if start >= size or start > end:
                raise HubError(416, f"Range {range_header!r} not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            data, status = data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return _Response(status, data, headers)

    def _lfs_batch(self, req: _Request, repo_type: str, repo_id: str) -> _Response:
        body = req.json()
        if body.get("operation") != "upload":
            raise HubError(400, "LocalHub only emulates LFS uploads (downloads go through /resolve)")
        objects = []
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            for obj in body.get("objects", []):
                oid, size = obj["oid"], int(obj["size"])
                if oid in repo.lfs_objects:
                    objects.append({"oid": oid, "size": size})  # already there: no action, the client skips it
                    continue
                key = secrets.token_urlsafe(24)
                self._lfs_uploads[key] = ((repo_type, repo_id), oid, size)
                href = f"{self.endpoint}/__lfs/upload/{key}"
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {"upload": {"href": href}}})
        return _json({"transfer": "basic", "objects": objects}, headers={"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_put(self, req: _Request, key: str) -> _Response:
        # The upload URL is the credential (like a pre-signed S3 URL): the client sends no Authorization here.
        with self._lock:
            pending = self._lfs_uploads.pop(key, None)
        if pending is None:
            raise HubError(403, "Unknown or already used LFS upload URL")
        repo_key, oid, size = pending
        data = req.body
        if len(data) != size or hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"Uploaded content does not match oid {oid} / size {size}")
        with self._lock:
            repo = self._repos.get(repo_key)
            if repo is None:
                raise HubError(404, "Repository not found", code="RepoNotFound")
            repo.lfs_objects[oid] = data
        return _Response(200)


_ENV_TO_REMOVE = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_OIDC_RESOURCE",
    "HF_OIDC_ID_TOKEN",
    "HUGGINGFACE_CO_STAGING",
)


def _check_path(path: str, error: type[Exception] = ValueError) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        if error is HubError:
            raise HubError(400, f"Invalid path in repo: {path!r}")
        raise error(f"Invalid path in repo: {path!r}")
    return path


@pytest.fixture
def local_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalHub]:
    """A running `LocalHub`, with this process's huggingface_hub / transformers pointed at it (see `LocalHub.patch`).

    Downloads go to a fresh cache (`tmp_path / "hf-cache"`, also `HF_HUB_CACHE`), and no ambient token is used:
    pass `token=` explicitly or set `HF_TOKEN` with monkeypatch.
    """
    hub = LocalHub().start()
    try:
        hub.patch(monkeypatch, cache_dir=tmp_path / "hf-cache")
        yield hub
    finally:
        hub.forget_client_caches()
        hub.stop()
