"""The frontend's socket, bound once by the supervisor and shared by its replicas: what
is bound, what a replica inherits, and that a replica's stop leaves the socket to the
next one (nothing queued is reset or refused while replicas come and go)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from splitserve.components.frontend.http_server import FrontendServer, HttpLimits, server_config
from splitserve.contracts.kit.shared_listener import (
    LISTEN_EARLY_VAR,
    LISTEN_FD_VAR,
    accept_queue_length,
    bind_listener,
    inherited_listener,
)
from splitserve.contracts.config import read_yaml
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan
from splitserve.serve.supervisor import ListenerError, bind_http_listeners

pytestmark = pytest.mark.unit


def plan_for(graph: str, source: str, *overrides: str):
    return build_plan(load_graph(graph), graph, read_yaml(source), source, list(overrides))


def test_the_frontend_alone_gets_a_socket_on_its_address():
    plan = plan_for("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                    "--Frontend.port=0", "--Frontend.replicas=2")
    bound = bind_http_listeners(plan)
    try:
        assert set(bound) == {"Frontend"}
        host, port = bound["Frontend"].getsockname()[:2]
        assert host == "127.0.0.1" and port > 0  # Common.bind_host, a free port
        assert bound["Frontend"].get_inheritable()
    finally:
        for sock in bound.values():
            sock.close()


def test_a_busy_port_is_refused_naming_the_field():
    with bind_listener("127.0.0.1", 0) as busy:
        port = busy.getsockname()[1]
        plan = plan_for("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                        f"--Frontend.port={port}")
        with pytest.raises(ListenerError, match=rf"Frontend\.port: cannot listen on "
                                                rf"127\.0\.0\.1:{port}: .*in use"):
            bind_http_listeners(plan)


def test_a_host_that_is_not_this_machines_is_refused_naming_the_field():
    plan = plan_for("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                    "--Frontend.host=192.0.2.1", "--Frontend.port=0")
    with pytest.raises(ListenerError, match=r"Frontend\.host: cannot listen on 192\.0\.2\.1"):
        bind_http_listeners(plan)


def test_a_replica_reads_the_socket_it_was_handed():
    assert inherited_listener({}) is None
    with bind_listener("127.0.0.1", 0) as sock:
        fd = os.dup(sock.fileno())
        got = inherited_listener({LISTEN_FD_VAR: str(fd), LISTEN_EARLY_VAR: "1"})
        try:
            assert got.early and got.port == sock.getsockname()[1]
            assert not got.sock.get_inheritable()  # the replica's own children do not hold it
        finally:
            got.sock.close()
        fd = os.dup(sock.fileno())
        got = inherited_listener({LISTEN_FD_VAR: str(fd)})
        assert not got.early
        got.sock.close()
    with socket.socket() as plain:  # not listening
        with pytest.raises(ValueError, match="not a listening TCP socket"):
            inherited_listener({LISTEN_FD_VAR: str(plain.fileno())})
    with pytest.raises(ValueError, match="not an open socket"):
        inherited_listener({LISTEN_FD_VAR: "x"})


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /who HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    body = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return body


def _replica(sock: socket.socket, name: str) -> tuple[FrontendServer, socket.socket]:
    app = Starlette(routes=[Route("/who", lambda request: PlainTextResponse(name))])
    server = FrontendServer(server_config(app, "127.0.0.1", 0, HttpLimits()))
    server.shared = True
    # Each replica holds its own descriptor of the one socket, as a child process does.
    return server, socket.socket(fileno=os.dup(sock.fileno()))


async def _start(server: FrontendServer, own: socket.socket) -> asyncio.Task:
    task = asyncio.create_task(server.serve(sockets=[own]))
    while not server.started:
        assert not task.done()
        await asyncio.sleep(0.01)
    return task


@pytest.mark.asyncio
async def test_a_connection_made_between_replicas_waits_for_the_next_one():
    with bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        first, own = _replica(sock, "first")
        task = await _start(first, own)
        assert (await _get(port)).endswith(b"first")
        first.should_exit = True
        await asyncio.wait_for(task, 10)
        # No replica accepts now: the kernel still completes the handshake (no drop
        # filter on a shared socket) and the connection waits in the accept queue.
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
        writer.write(b"GET /who HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        assert accept_queue_length(sock.fileno()) == 1
        second, own = _replica(sock, "second")
        task = await _start(second, own)
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"second")
        second.should_exit = True
        await asyncio.wait_for(task, 10)


@pytest.mark.asyncio
async def test_two_replicas_accept_from_one_socket():
    with bind_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        servers = [_replica(sock, name) for name in ("a", "b")]
        tasks = [await _start(server, own) for server, own in servers]
        answers = await asyncio.gather(*(_get(port) for _ in range(20)))
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
        for server, _ in servers:
            server.should_exit = True
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
