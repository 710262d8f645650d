"""Shutdown closes a NATS connection that cannot drain instead of failing the process."""

import asyncio
import logging

import pytest
from nats.errors import ConnectionReconnectingError

from splitserve.contracts.kit.connect import close_nats

pytestmark = pytest.mark.unit


class Conn:
    def __init__(self, connected: bool, drain_error: Exception | None = None) -> None:
        self.is_connected = connected
        self.drain_error = drain_error
        self.calls: list[str] = []

    async def drain(self) -> None:
        self.calls.append("drain")
        if self.drain_error is not None:
            raise self.drain_error

    async def close(self) -> None:
        self.calls.append("close")


@pytest.mark.parametrize(("conn", "calls"), [
    (Conn(True), ["drain"]),
    (Conn(False), ["close"]),  # reconnecting: nothing can be flushed
    (Conn(True, ConnectionReconnectingError()), ["drain", "close"]),  # went down meanwhile
])
def test_close_nats(conn, calls, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.nats")
    asyncio.run(close_nats(conn, "test"))
    assert conn.calls == calls
    if conn.drain_error is not None:
        assert "could not drain the test connection" in caplog.text
