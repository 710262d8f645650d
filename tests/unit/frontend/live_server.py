"""A real uvicorn server with the frontend's protocol, in a thread, for raw-socket tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from splitserve.components.frontend.app import build_app
from splitserve.components.frontend.http_server import FrontendServer, HttpLimits, server_config


@dataclass
class Running:
    """The frontend's server running in a thread: its loop, the server and its address."""

    server: FrontendServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    addr: tuple[str, int]

    def stop(self, timeout_s: float = 10) -> None:
        """Ask the server to stop and wait until it has (idempotent)."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def running(state, limits: HttpLimits) -> Iterator[Running]:
    """Serve ``build_app(state)`` with the frontend's server on a free loopback port."""
    server = FrontendServer(server_config(build_app(state), "127.0.0.1", 0, limits))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    run = Running(server, loop, thread, ("127.0.0.1", port))
    try:
        yield run
    finally:
        server.should_exit = True
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def serve(state, limits: HttpLimits) -> Iterator[tuple[str, int]]:
    """Serve ``build_app(state)`` on a free loopback port; yields (host, port)."""
    with running(state, limits) as run:
        yield run.addr


def connect(addr: tuple[str, int], timeout_s: float = 10) -> socket.socket:
    return socket.create_connection(addr, timeout=timeout_s)


def read_response(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (or the socket times out); closes ``s``."""
    out = bytearray()
    with s, contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return bytes(out)


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (ln.partition(":") for ln in lines[1:])}
    return status, headers, body
