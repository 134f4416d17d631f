"""LocalHub endpoints that write: preupload, the ndjson commit, and the basic git-LFS batch upload."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from typing import Any

from .hub_http import HubError, Request, Response, check_path, json_response
from .hub_storage import Blob, Repo


class UploadEndpoints:
    """Mixed into `LocalHub` (uses its lock, repos, pending LFS uploads and repo helpers)."""

    def _preupload(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
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
        return json_response({"files": answers, "commitOid": head.id})

    def _commit(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
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
                if key != "header":
                    self._apply_operation(repo, tree, key, value)
            branch = revision[len("refs/heads/") :] if revision.startswith("refs/heads/") else revision
            commit = self._make_commit(
                repo, head.id, tree, header["summary"], header.get("description") or "", self.username
            )
            repo.branches[branch] = commit.id
        return json_response(
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

    @staticmethod
    def _apply_operation(repo: Repo, tree: dict[str, Blob], key: str | None, value: dict[str, Any]) -> None:
        """Apply one commit operation (file, lfsFile, deletedFile, deletedFolder) to `tree`, in place."""
        if key in ("file", "lfsFile", "deletedFile", "deletedFolder"):
            raw_path = value.get("path", "")
            path = check_path(raw_path.rstrip("/") if key == "deletedFolder" else raw_path, HubError)
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

    def _lfs_batch(self, req: Request, repo_type: str, repo_id: str) -> Response:
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
        return json_response(
            {"transfer": "basic", "objects": objects}, headers={"Content-Type": "application/vnd.git-lfs+json"}
        )

    def _lfs_put(self, req: Request, key: str) -> Response:
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
        return Response(200)
