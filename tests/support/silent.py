"""A TCP server that accepts every connection and never answers: the endpoint that used to make hftrain hang."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest


class SilentServer:
    """Listens on 127.0.0.1, accepts, reads nothing and writes nothing; connections stay open until stop()."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True, name="SilentServer")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    try:
        yield server
    finally:
        server.stop()
