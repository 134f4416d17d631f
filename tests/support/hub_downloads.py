"""LocalHub endpoints that read a revision: repo info, tree and paths-info listings, and file downloads (resolve)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs

from .hub_http import HubError, Request, Response, json_response
from .hub_storage import Blob, iso


class DownloadEndpoints:
    """Mixed into `LocalHub` (uses its lock and repo helpers)."""

    def _info(self, req: Request, repo_type: str, repo_id: str, revision: str | None) -> Response:
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
                    sibling["lfs"] = {
                        "size": blob.size,
                        "sha256": blob.lfs_sha256,
                        "pointerSize": len(blob.pointer or b""),
                    }
            siblings.append(sibling)
        return json_response(
            {
                "_id": repo.uid,
                "id": repo.repo_id,
                "author": repo.repo_id.split("/")[0],
                "sha": commit.id,
                "lastModified": iso(commit.date),
                "createdAt": iso(repo.created_at),
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

    def _tree(self, req: Request, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
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
        return json_response(list(entries.values()))

    def _paths_info(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
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
        return json_response(out)

    def _resolve(self, req: Request, repo_type: str, repo_id: str, revision: str, path: str) -> Response:
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
                raise HubError(
                    416, f"Range {range_header!r} not satisfiable", headers={"Content-Range": f"bytes */{size}"}
                )
            data, status = data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return Response(status, data, headers)

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
