"""The LocalHub's storage: repos, commits and file blobs in memory, with git-like ids (see `tests.support.hub`)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

REPO_TYPES = ("model", "dataset")
URL_PREFIX = {"model": "", "dataset": "datasets/"}
API_SEGMENT = {"models": "model", "datasets": "dataset"}
REPO_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?$")
COMMIT_ID = re.compile(r"^[0-9a-f]{40}$")

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


def iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def now() -> datetime:
    return datetime.now(timezone.utc)


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
        return URL_PREFIX[self.repo_type] + self.repo_id

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
        if COMMIT_ID.fullmatch(revision) and revision in self.commits:
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
