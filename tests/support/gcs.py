"""A small local Google Cloud Storage endpoint for tests: the read side of the GCS JSON API, over real HTTP.

gcsfs talks to it exactly as to storage.googleapis.com (``STORAGE_EMULATOR_HOST``, anonymous token): bucket
metadata, object listing with prefix/delimiter/pagination, object metadata, and media downloads with Range.
Objects are files under a temp directory (``root/BUCKET/KEY``). Every request line is kept in ``requests``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from hftrain import _compat

# gcsfs as hftrain reads gs:// (its JSON API), whichever test imports gcsfs first in this process: imported before
# hftrain's setting, gcsfs's default filesystem spent ~25 s per bucket asking a gRPC control plane this endpoint
# does not serve (_compat.plain_gcs_filesystem)
_compat.plain_gcs_filesystem()

PAGE = 3  # small pages, so listings of a few shards already exercise nextPageToken


def _meta(bucket: str, key: str, path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    stamp = "2024-01-01T00:00:00.000Z"
    generation = str(int(path.stat().st_mtime_ns))
    return {
        "kind": "storage#object",
        "id": f"{bucket}/{key}/{generation}",
        "name": key,
        "bucket": bucket,
        "size": str(len(data)),
        "generation": generation,
        "metageneration": "1",
        "storageClass": "STANDARD",
        "contentType": "application/octet-stream",
        "timeCreated": stamp,
        "updated": stamp,
        "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
        "etag": generation,
        "selfLink": f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}",
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(
        self, status: int, body: bytes, ctype: str = "application/json", extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode())

    def _not_found(self, what: str) -> None:
        self._json(
            {"error": {"code": 404, "message": f"No such object: {what}", "errors": [{"reason": "notFound"}]}}, 404
        )

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        ranged = f" Range: {self.headers['Range']}" if self.headers.get("Range") else ""
        self.server.requests.append(f"{self.command} {self.path}{ranged}")
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        parts = url.path.split("/")
        if parts[1:2] == ["download"]:
            parts = parts[:1] + parts[2:]
        # ['', 'storage', 'v1', 'b', BUCKET, 'o', OBJECT...]
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 5:
            return self._json({"error": {"code": 400, "message": f"unsupported: {url.path}"}}, 400)
        bucket = unquote(parts[4])
        base = self.server.root / bucket
        if not base.is_dir():
            return self._json({"error": {"code": 404, "message": "The specified bucket does not exist."}}, 404)
        if len(parts) == 5:
            return self._json({"kind": "storage#bucket", "id": bucket, "name": bucket, "location": "US"})
        if parts[5] != "o":
            return self._json({"error": {"code": 400, "message": f"unsupported: {url.path}"}}, 400)
        if len(parts) == 6 or parts[6] == "":
            return self._json(self._list(bucket, base, query))
        key = unquote("/".join(parts[6:]))
        path = base / key
        if not path.is_file():
            return self._not_found(f"{bucket}/{key}")
        if query.get("alt") == "media":
            return self._media(path)
        self._json(_meta(bucket, key, path))

    def _list(self, bucket: str, base: Path, query: dict[str, str]) -> dict[str, Any]:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        keys = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
        entries: list[tuple[str, bool]] = []  # (name, is_prefix), in name order like GCS
        seen: set[str] = set()
        for key in keys:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                sub = prefix + rest.split(delimiter, 1)[0] + delimiter
                if sub not in seen:
                    seen.add(sub)
                    entries.append((sub, True))
            else:
                entries.append((key, False))
        start = int(query.get("pageToken") or 0)
        size = min(int(query.get("maxResults") or PAGE), PAGE)
        page = entries[start : start + size]
        out: dict[str, Any] = {"kind": "storage#objects"}
        out["items"] = [_meta(bucket, name, base / name) for name, is_prefix in page if not is_prefix]
        out["prefixes"] = [name for name, is_prefix in page if is_prefix]
        if start + size < len(entries):
            out["nextPageToken"] = str(start + size)
        return out

    def _media(self, path: Path) -> None:
        data = path.read_bytes()
        ranged = self.headers.get("Range", "")
        if not ranged.startswith("bytes="):
            return self._send(200, data, "application/octet-stream")
        first, _, last = ranged[6:].partition("-")
        start = int(first) if first else max(len(data) - int(last), 0)
        end = min(int(last), len(data) - 1) if first and last else len(data) - 1
        if start >= len(data):
            return self._send(416, b"", extra={"Content-Range": f"bytes */{len(data)}"})
        self._send(
            206,
            data[start : end + 1],
            "application/octet-stream",
            {"Content-Range": f"bytes {start}-{end}/{len(data)}"},
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    requests: list[str]


@dataclass
class GCSEndpoint:
    """A running local GCS endpoint: objects are files under ``root``."""

    root: Path
    endpoint_url: str
    requests: list[str] = field(default_factory=list)

    def put(self, url: str, body: bytes) -> str:
        bucket, _, key = url.removeprefix("gs://").partition("/")
        path = self.root / bucket / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        return f"gs://{bucket}/{key}"


@pytest.fixture
def gcs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GCSEndpoint]:
    """A local GCS endpoint for one test, reached through the standard STORAGE_EMULATOR_HOST variable."""
    import gcsfs

    server = _Server(("127.0.0.1", 0), _Handler)
    server.root, server.requests = tmp_path / "gcs", []
    server.root.mkdir()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = GCSEndpoint(server.root, f"http://127.0.0.1:{server.server_address[1]}", server.requests)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint.endpoint_url)
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        yield endpoint
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        server.shutdown()
        server.server_close()
