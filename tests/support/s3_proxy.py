"""An S3 fault-injecting proxy, for tests (put between a client and the endpoint of ``tests.support.s3``).

What the proxy injects
----------------------
:class:`FaultProxy` is a small HTTP/1.1 proxy (standard library only, one thread per client connection) put
between a client and the moto endpoint.  It parses each request from the client (headers and
``Content-Length`` or chunked body, keep-alive aware), forwards it with :mod:`http.client` and writes the
response back.  On a schedule it answers the request itself instead, with one of these faults:

* ``"reset"``: the connection is dropped without any answer (TCP RST: ``SO_LINGER`` 0, then close);
* ``"midbody"``: the request is forwarded, the status line, the headers and half of the body are written
  back, then the connection is dropped with a RST (a stream cut in the middle of the data);
* ``"500"``: ``500 InternalError`` with S3's XML error body;
* ``"503"``: ``503 SlowDown`` (S3's throttling answer) with S3's XML error body.

With ``only_get=True`` (the default) only GETs of object data (``GET /bucket/key``, not listings, HEADs,
PUTs or bucket operations) are eligible, so bucket setup through the proxy is never disturbed, and the
schedule counts eligible requests only: ``schedule={1: "reset", 3: "503"}`` faults the 1st and 3rd object
GET that reaches the proxy.  ``every=N`` faults every Nth eligible request instead (``every_fault`` names
the fault, or a list of faults used in turn).  ``proxy.requests`` records every request seen and
``proxy.faults`` every fault injected.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

FAULTS = ("reset", "midbody", "500", "503")

_S3_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}


@dataclass
class ProxyRequest:
    """One request seen by a FaultProxy."""

    n: int  # 1-based, over all requests
    method: str
    path: str
    eligible: int | None  # 1-based among fault-eligible requests, None when not eligible
    fault: str | None = None  # the fault injected, if any
    status: int | None = None  # the status written back (None for a reset)
    conn: int = 0  # 1-based number of the client connection it came on (keep-alive reuse shows here)


class FaultProxy:
    """An HTTP/1.1 proxy in front of an S3 endpoint that injects faults on a schedule.

    ``FaultProxy(upstream_url, schedule={3: "reset", 5: "503", 8: "500"})`` faults the 3rd, 5th and 8th
    eligible request; ``FaultProxy(upstream_url, every=2, every_fault=["reset", "500"])`` faults every 2nd one,
    alternating.  Faults: "reset", "midbody", "500", "503" (see the module docstring).  With ``only_get``
    (default) only object GETs are eligible.  Use as a context manager or with start()/stop(); point a
    client at ``proxy.endpoint_url``.
    """

    def __init__(
        self,
        upstream_url: str,
        schedule: dict[int, str] | None = None,
        *,
        every: int | None = None,
        every_fault: str | Sequence[str] = "reset",
        only_get: bool = True,
        timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy forwards to a plain http:// upstream, got {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.schedule = dict(schedule or {})
        kinds = [every_fault] if isinstance(every_fault, str) else list(every_fault)
        for kind in [*self.schedule.values(), *kinds]:
            if kind not in FAULTS:
                raise ValueError(f"unknown fault {kind!r}; expected one of {FAULTS}")
        if every is not None and every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self._every_kinds = itertools.cycle(kinds)
        self.only_get = only_get
        self.timeout = timeout
        self.requests: list[ProxyRequest] = []
        self.faults: list[ProxyRequest] = []
        self._lock = threading.Lock()
        self._eligible_count = 0
        self._conn_count = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self.endpoint_url = ""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        self._stopping.clear()
        self.endpoint_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="FaultProxy-accept", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in [self._accept_thread, *threads]:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
        self._listener = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- accounting --------------------------------------------------------------------------------

    def fault_counts(self) -> Counter:
        """Faults injected so far, by kind."""
        with self._lock:
            return Counter(r.fault for r in self.faults)

    @property
    def eligible_requests(self) -> list[ProxyRequest]:
        with self._lock:
            return [r for r in self.requests if r.eligible is not None]

    def _is_eligible(self, method: str, path: str) -> bool:
        if not self.only_get:
            return True
        bucket_and_key = path.split("?", 1)[0].lstrip("/")
        return method == "GET" and "/" in bucket_and_key and bool(bucket_and_key.split("/", 1)[1])

    def _record(self, method: str, path: str, conn_no: int) -> ProxyRequest:
        with self._lock:
            eligible = None
            fault = None
            if self._is_eligible(method, path):
                self._eligible_count += 1
                eligible = self._eligible_count
                fault = self.schedule.get(eligible)
                if fault is None and self.every and eligible % self.every == 0:
                    fault = next(self._every_kinds)
            record = ProxyRequest(len(self.requests) + 1, method, path, eligible, fault, conn=conn_no)
            self.requests.append(record)
            if fault is not None:
                self.faults.append(record)
            return record

    # -- serving -----------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conn_count += 1
                conn_no = self._conn_count
            thread = threading.Thread(target=self._serve, args=(conn, conn_no), name="FaultProxy-conn", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, conn_no: int) -> None:
        upstream: http.client.HTTPConnection | None = None
        rfile = conn.makefile("rb")
        try:
            conn.settimeout(self.timeout)
            while not self._stopping.is_set():
                request = self._read_request(rfile, conn)
                if request is None:
                    return
                method, path, version, headers, body = request
                record = self._record(method, path, conn_no)
                if record.fault == "reset":
                    self._reset(conn, rfile)
                    return
                if record.fault in _S3_ERRORS:
                    record.status = self._send_s3_error(conn, record.fault, path)
                    continue
                if upstream is None:
                    upstream = http.client.HTTPConnection(*self.upstream, timeout=self.timeout)
                status, reason, resp_headers, resp_body, upstream = self._forward(upstream, method, path, headers, body)
                record.status = status
                keep_alive = version == "HTTP/1.1" and "close" not in _header(headers, "connection").lower()
                head = self._response_head(status, reason, resp_headers, method, len(resp_body), keep_alive)
                if record.fault == "midbody":
                    conn.sendall(head + resp_body[: len(resp_body) // 2])
                    self._reset(conn, rfile)
                    return
                conn.sendall(head + resp_body)
                if not keep_alive:
                    return
        except (OSError, http.client.HTTPException, ValueError):
            return
        finally:
            try:
                rfile.close()
            except OSError:
                pass
            try:
                conn.close()
            except OSError:
                pass
            if upstream is not None:
                upstream.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    @staticmethod
    def _read_request(rfile: Any, conn: socket.socket) -> tuple[str, str, str, list[tuple[str, str]], bytes] | None:
        line = rfile.readline(65537)
        while line in (b"\r\n", b"\n"):  # tolerate stray CRLF between requests
            line = rfile.readline(65537)
        if not line:
            return None  # the client closed the connection
        method, path, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        message = http.client.parse_headers(rfile)
        headers = list(message.items())
        if "100-continue" in _header(headers, "expect").lower():
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in _header(headers, "transfer-encoding").lower():
            chunks = []
            while True:
                size = int(rfile.readline(65537).split(b";")[0].strip(), 16)
                if size == 0:
                    while rfile.readline(65537) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    break
                chunks.append(rfile.read(size))
                rfile.readline(65537)
            body = b"".join(chunks)
        else:
            length = int(_header(headers, "content-length") or 0)
            body = rfile.read(length) if length else b""
            if len(body) != length:
                return None
        return method, path, version, headers, body

    def _forward(
        self, upstream: http.client.HTTPConnection, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes, http.client.HTTPConnection]:
        for attempt in range(2):  # an idle keep-alive connection may have been closed by the upstream
            try:
                upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        upstream.putheader(name, value)
                if body or method in ("PUT", "POST", "PATCH"):
                    upstream.putheader("Content-Length", str(len(body)))
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                resp_body = response.read()
                resp_headers = list(response.getheaders())
                if response.will_close:
                    upstream.close()
                return response.status, response.reason, resp_headers, resp_body, upstream
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest, BrokenPipeError):
                upstream.close()
                upstream = http.client.HTTPConnection(*self.upstream, timeout=self.timeout)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _response_head(
        status: int, reason: str, headers: list[tuple[str, str]], method: str, body_len: int, keep_alive: bool
    ) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        for name, value in headers:
            low = name.lower()
            if low in _HOP_BY_HOP:
                continue
            if low == "content-length" and method != "HEAD":
                continue  # rewritten below: the body was de-chunked by http.client
            lines.append(f"{name}: {value}")
        if method != "HEAD" and status not in (204, 304) and not 100 <= status < 200:
            lines.append(f"Content-Length: {body_len}")
        lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    @staticmethod
    def _send_s3_error(conn: socket.socket, kind: str, path: str) -> int:
        status, reason, code, message = _S3_ERRORS[kind]
        request_id = uuid.uuid4().hex[:16].upper()
        resource = path.split("?", 1)[0]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{request_id}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {reason}\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"x-amz-request-id: {request_id}\r\n"
            "Connection: keep-alive\r\n\r\n"
        )
        conn.sendall(head.encode("latin-1") + body)
        return status

    @staticmethod
    def _reset(conn: socket.socket, rfile: Any) -> None:
        """Drop the connection with a TCP RST (no FIN): SO_LINGER 0, then close every handle on it."""
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        rfile.close()  # the fd is only released once the makefile() reader is closed too
        conn.close()


def _header(headers: list[tuple[str, str]], name: str) -> str:
    name = name.lower()
    for key, value in headers:
        if key.lower() == name:
            return value
    return ""
