"""The one ZMQ subscriber loop that relays an engine's KV-event batches (vLLM, SGLang).

Both engines' publishers *connect* to a specific-host endpoint, so the subscriber binds
and must be up before the engine starts: then no early event is missed and nothing
listens beyond loopback.  Each engine supplies only how its batch payload becomes this
project's KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec

from splitserve.components.engines.torch_cpu.kv_events import KvEvent

LOOPBACK_PREFIX = "tcp://127.0.0.1:"


async def relay_batches(endpoint: str, convert: Callable[[bytes], list[KvEvent]],
                        sink: Callable[[list[KvEvent]], None], log: logging.Logger,
                        ready: asyncio.Event | None = None) -> None:
    """Bind ``endpoint`` (``tcp://127.0.0.1:PORT``), feed converted batches to ``sink``
    until cancelled; ``ready`` is set once the socket is bound.  A batch that cannot be
    decoded is logged and skipped, never fatal."""
    import zmq
    import zmq.asyncio

    if not endpoint.startswith(LOOPBACK_PREFIX):
        raise ValueError(f"the KV event relay listens on loopback only, got {endpoint!r}")
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    if ready is not None:
        ready.set()
    try:
        while True:
            parts = await sub.recv_multipart()
            if len(parts) != 3:  # topic, sequence number, payload
                continue
            try:
                events = convert(parts[2])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable KV event batch: %s", exc)
                continue
            if events:
                sink(events)
    finally:
        with contextlib.suppress(Exception):
            sub.close(0)
