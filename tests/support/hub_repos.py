"""LocalHub endpoints for repos and their refs: whoami, create / delete / settings, branches, tags, refs, history."""

from __future__ import annotations

import hashlib

from .hub_http import HubError, Request, Response, json_response
from .hub_storage import REPO_TYPES, iso


class RepoEndpoints:
    """Mixed into `LocalHub` (uses its lock, repos and repo helpers)."""

    def _whoami(self, req: Request) -> Response:
        if req.token is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return json_response(
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

    def _create_repo(self, req: Request) -> Response:
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
        return json_response({"url": self._url(repo), "name": repo_id, "id": repo.uid})

    def _delete_repo(self, req: Request) -> Response:
        self._require_token(req)
        body = req.json()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or self.username}/{body.get('name')}"
        with self._lock:
            self._write_repo(req, repo_type, repo_id)
            del self._repos[(repo_type, repo_id)]
        return json_response({})

    def _settings(self, req: Request, repo_type: str, repo_id: str) -> Response:
        body = req.json()
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if "visibility" in body:
                repo.private = body["visibility"] == "private"
            elif "private" in body:
                repo.private = bool(body["private"])
        return json_response({})

    def _refs(self, req: Request, repo_type: str, repo_id: str) -> Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            branches = [
                {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in sorted(repo.branches.items())
            ]
            tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in sorted(repo.tags.items())]
        return json_response({"branches": branches, "converts": [], "tags": tags, "pullRequests": []})

    def _commits(self, req: Request, repo_type: str, repo_id: str, revision: str) -> Response:
        with self._lock:
            repo = self._read_repo(req, repo_type, repo_id)
            self._resolve_rev(repo, revision)
            history = repo.history(revision)
        return json_response(
            [
                {
                    "id": c.id,
                    "title": c.title,
                    "message": c.message,
                    "authors": [{"user": c.author, "avatar": ""}],
                    "date": iso(c.date),
                }
                for c in history
            ]
        )

    def _branch(self, req: Request, repo_type: str, repo_id: str, branch: str) -> Response:
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if req.method == "DELETE":
                if branch not in repo.branches:
                    raise HubError(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "You cannot delete the default branch")
                del repo.branches[branch]
                return json_response({})
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            if branch.startswith("refs/") or not branch or ".." in branch:
                raise HubError(400, f"Invalid branch name: {branch}")
            start = self._resolve_rev(repo, req.json().get("startingPoint") or "main")
            repo.branches[branch] = start.id
        return json_response({})

    def _tag(self, req: Request, repo_type: str, repo_id: str, arg: str) -> Response:
        with self._lock:
            repo = self._write_repo(req, repo_type, repo_id)
            if req.method == "DELETE":
                if repo.tags.pop(arg, None) is None:
                    raise HubError(404, f"Invalid rev id: {arg}", code="RevisionNotFound")
                return json_response({})
            tag = req.json().get("tag") or ""
            if not tag:
                raise HubError(400, "Missing tag name")
            if tag in repo.tags:
                raise HubError(409, f"Tag already exists: {tag}")
            repo.tags[tag] = self._resolve_rev(repo, arg).id
        return json_response({})
