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
from typing import Any

import msgspec

from splitserve.contracts.kit.procs import free_port
from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent, Tier

LOOPBACK_PREFIX = "tcp://127.0.0.1:"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the relay binds it moments later)."""
    return free_port("127.0.0.1")


def block_hash(h: bytes | int) -> int:
    """An engine's block hash (bytes or int) as the signed 64-bit int Dynamo's events carry.

    Only identity matters: the router indexes tokens by its own hash and uses these to
    chain parents and to remove blocks, so any stable injective-enough map works.
    """
    if isinstance(h, int):
        return ((h + (1 << 63)) % (1 << 64)) - (1 << 63)
    return int.from_bytes(bytes(h)[:8].ljust(8, b"\0"), "little", signed=True)


# An engine event's ``medium`` (vLLM, SGLang) as this project's tier; the names are those
# Dynamo's router maps too.  A medium not listed (an external store) has no tier here.
MEDIUM_TIERS: dict[str | None, Tier] = {
    None: "device", "GPU": "device", "DEVICE": "device", "CPU": "host", "CPU_PINNED": "host",
    "CPU_TIER1": "host", "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk",
    "STORAGE": "disk"}


def tier_of(ev: Any) -> Tier | None:
    """The tier an engine event is about (None: a medium this project does not track)."""
    medium = getattr(ev, "medium", None)
    return MEDIUM_TIERS.get(medium.upper() if isinstance(medium, str) else medium)


def stored_event(ev: Any, block_size: int, tier: Tier = "device") -> BlockStored:
    """A ``BlockStored`` of vLLM's or SGLang's (same fields) as this project's event; the
    caller has checked that its tokens fill its blocks of ``block_size``."""
    parent = None if ev.parent_block_hash is None else block_hash(ev.parent_block_hash)
    return BlockStored(block_hashes=tuple(block_hash(h) for h in ev.block_hashes),
                       parent_hash=parent, token_ids=tuple(ev.token_ids),
                       num_block_tokens=(block_size,) * len(ev.block_hashes), tier=tier)


def removed_event(ev: Any, tier: Tier = "device") -> BlockRemoved:
    """A ``BlockRemoved`` of vLLM's or SGLang's as this project's event."""
    return BlockRemoved(tuple(block_hash(h) for h in ev.block_hashes), tier=tier)


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
