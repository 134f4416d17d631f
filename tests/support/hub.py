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

Code: this module holds `LocalHub` (lifecycle, seeding, routing, shared repo helpers) and the fixture; the storage
is in `hub_storage`, the HTTP plumbing in `hub_http`, the client setup in `hub_client`, and the endpoints by area
in `hub_repos` (repos and refs), `hub_uploads` (preupload, commit, LFS) and `hub_downloads` (info, listings, resolve).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from .hub_client import ClientSetup
from .hub_downloads import DownloadEndpoints
from .hub_http import Handler, HubError, Request, Response, check_path, json_response
from .hub_repos import RepoEndpoints
from .hub_storage import (
    API_SEGMENT,
    GITATTRIBUTES,
    REPO_NAME,
    REPO_TYPES,
    URL_PREFIX,
    Blob,
    Commit,
    Repo,
    RequestRecord,
    now,
)
from .hub_uploads import UploadEndpoints

__all__ = ["Blob", "Commit", "LocalHub", "Repo", "RequestRecord", "local_hub"]


class LocalHub(ClientSetup, RepoEndpoints, UploadEndpoints, DownloadEndpoints):
    """An in-memory Hugging Face Hub on 127.0.0.1; see the module docstring for what it emulates.

    Use as `with LocalHub() as hub: ...` or `hub.start()` / `hub.stop()`. `hub.endpoint` is the base URL to use as
    `HF_ENDPOINT`; `hub.tokens_seen` the set of bearer tokens received; `hub.repos` the repos by key (`ns/name` for
    models, `datasets/ns/name` for datasets); `hub.requests` one `RequestRecord` per request answered.
    """

    def __init__(
        self, *, username: str = "local-user", valid_tokens: set[str] | None = None, lfs_threshold: int | None = None
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
        handler = type("LocalHubHandler", (Handler,), {"hub": self})
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
        if not (REPO_NAME.fullmatch(ns) and REPO_NAME.fullmatch(name)) or "--" in repo_id or ".." in repo_id:
            raise ValueError(f"Invalid repo id {repo_id!r}: expected 'namespace/name'")
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                return self._repos[(repo_type, repo_id)]
            repo = Repo(repo_type, repo_id, private, now(), secrets.token_hex(12))
            first = self._make_commit(
                repo, None, {".gitattributes": Blob(GITATTRIBUTES)}, "initial commit", "", "system"
            )
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
            blobs[check_path(path)] = Blob(data)
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            head = repo.commits[repo.branches[branch]]
            tree = {p: b for p, b in head.files.items() if p not in delete}
            tree.update(blobs)
            commit = self._make_commit(repo, head.id, tree, message, "", self.username)
            repo.branches[branch] = commit.id
            return commit.id

    # ---- request handling ------------------------------------------------------------------------------------------

    def _handle(self, req: Request) -> Response:
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

    def _not_emulated(self, req: Request) -> Response:
        path = "/" + "/".join(req.segments)
        with self._lock:
            self.unhandled.append(f"{req.method} {path}")
        raise HubError(404, f"LocalHub does not emulate {req.method} {path}")

    def _api(self, req: Request, segs: list[str]) -> Response:
        m = req.method
        if segs == ["whoami-v2"] and m == "GET":
            return self._whoami(req)
        if segs == ["repos", "create"] and m == "POST":
            return self._create_repo(req)
        if segs == ["repos", "delete"] and m == "DELETE":
            return self._delete_repo(req)
        if segs == ["validate-yaml"] and m == "POST":
            return json_response({"errors": [], "warnings": []})
        if segs[:1] == ["telemetry"]:
            return json_response({})
        if len(segs) >= 3 and segs[0] in API_SEGMENT:
            repo_type, repo_id, rest = API_SEGMENT[segs[0]], f"{segs[1]}/{segs[2]}", segs[3:]
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
        return f"{self.endpoint}/{URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    @staticmethod
    def _require_token(req: Request) -> None:
        if req.token is None:
            raise HubError(401, "Unauthorized: this operation needs a token (Authorization: Bearer ...)")

    def _read_repo(self, req: Request, repo_type: str, repo_id: str) -> Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and req.token is None):
            status = 401 if req.token is None else 404
            raise HubError(status, "Repository not found", code="RepoNotFound")
        return repo

    def _write_repo(self, req: Request, repo_type: str, repo_id: str) -> Repo:
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
        date = now()
        tree = hashlib.sha1("".join(f"{p}\0{b.oid}\n" for p, b in sorted(files.items())).encode()).hexdigest()
        text = f"tree {tree}\n"
        text += f"parent {parent}\n" if parent else ""
        text += (
            f"author {author} {date.timestamp():.6f} +0000\nx-localhub-seq {next(self._seq)}\n\n{title}\n\n{message}"
        )
        raw = text.encode()
        commit_id = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
        commit = Commit(commit_id, (parent,) if parent else (), dict(files), title, message, author, date)
        repo.commits[commit_id] = commit
        return commit


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
