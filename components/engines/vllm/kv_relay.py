"""Relay of vLLM's KV events (its ZMQ publisher) into this project's KV event types.

vLLM's engine core publishes each step's ``KVEventBatch`` as a ZMQ multipart message
``(topic, 8-byte sequence, msgpack batch)`` to a loopback TCP socket; the worker turns
every ``BlockStored`` / ``BlockRemoved`` into the same events the torch engine emits and
hands them to the publisher that feeds the routers' radix trees.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import msgspec

from splitserve.components.engines.torch_cpu.kv_events import BlockRemoved, BlockStored, KvEvent
from splitserve.components.engines.zmq_relay import relay_batches

log = logging.getLogger("splitserve.vllm")


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the relay binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_hash(h: bytes | int) -> int:
    """vLLM block hash (bytes or int) as the signed 64-bit int Dynamo's events carry.

    Only identity matters: the router indexes tokens by its own hash and uses these to
    chain parents and to remove blocks, so any stable injective-enough map works.
    """
    if isinstance(h, int):
        return ((h + (1 << 63)) % (1 << 64)) - (1 << 63)
    return int.from_bytes(bytes(h)[:8].ljust(8, b"\0"), "little", signed=True)


def convert_batch(raw: bytes, block_size: int) -> list[KvEvent]:
    """Decode one msgpack ``KVEventBatch`` into BlockStored / BlockRemoved events.

    ``AllBlocksCleared`` has no counterpart in the project's events and is dropped (the
    blocks age out of the router's tree through removal events instead).
    """
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(raw, type=KVEventBatch)
    events: list[KvEvent] = []
    for ev in batch.events:
        if isinstance(ev, VBlockStored):
            bs = ev.block_size or block_size
            n = len(ev.block_hashes)
            if len(ev.token_ids) != n * bs:
                log.warning("skipping a BlockStored of %d tokens for %d blocks of %d",
                            len(ev.token_ids), n, bs)
                continue
            parent = None if ev.parent_block_hash is None else block_hash(ev.parent_block_hash)
            events.append(BlockStored(
                block_hashes=tuple(block_hash(h) for h in ev.block_hashes),
                parent_hash=parent, token_ids=tuple(ev.token_ids),
                num_block_tokens=(bs,) * n))
        elif isinstance(ev, VBlockRemoved):
            events.append(BlockRemoved(tuple(block_hash(h) for h in ev.block_hashes)))
    return events


async def relay(endpoint: str, block_size: int, sink: Callable[[list[KvEvent]], None],
                ready: asyncio.Event | None = None) -> None:
    """Subscribe to vLLM's publisher at ``endpoint`` and feed ``sink`` until cancelled.

    vLLM's publisher *connects* to a specific-host TCP endpoint (it binds only wildcard
    or ipc addresses), so this subscriber binds the loopback address and must be started
    before the engine: then no early event is missed and nothing listens beyond
    127.0.0.1.
    """
    await relay_batches(endpoint, lambda raw: convert_batch(raw, block_size), sink, log, ready)
