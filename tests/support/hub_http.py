"""The LocalHub's HTTP plumbing: requests parsed into `Request`, answers built as `Response`, errors as `HubError`."""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_storage import RequestRecord

if TYPE_CHECKING:
    from .hub import LocalHub


class HubError(Exception):
    """An error answer: JSON {"error": message}, with the `X-Error-Code` / `X-Error-Message` headers the client
    reads."""

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
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


@dataclass
class Request:
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


class Handler(BaseHTTPRequestHandler):
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
        request = Request(
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
            response = json_response({"error": e.message, **e.extra}, e.status, e.headers)
            response.headers["X-Error-Message"] = e.message.encode("ascii", "replace").decode()
            if e.code:
                response.headers["X-Error-Code"] = e.code
        except Exception:  # a bug in the emulator: answer 500 with the traceback, keep serving
            tb = traceback.format_exc()
            hub.errors.append(tb)
            response = json_response({"error": f"LocalHub internal error:\n{tb}"}, 500)
        with hub._lock:
            hub.requests.append(RequestRecord(method, self.path, request.token, response.status))
        self.send_response(response.status)
        headers = {"Content-Length": str(len(response.body)), **response.headers}
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(response.body)


def check_path(path: str, error: type[Exception] = ValueError) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        if error is HubError:
            raise HubError(400, f"Invalid path in repo: {path!r}")
        raise error(f"Invalid path in repo: {path!r}")
    return path
