"""Relay of SGLang's KV events (its ZMQ publisher) into this project's KV event types.

SGLang's scheduler publishes each step's ``KVEventBatch`` as a ZMQ multipart message
``(topic, 8-byte sequence, msgpack batch)``; its ``BlockStored`` / ``BlockRemoved`` have
vLLM's shape (SGLang kept the encoding so one consumer reads both).  The relay listens on
a loopback port and SGLang's publisher connects to it (a concrete host makes it connect),
so nothing listens beyond 127.0.0.1 and no early event is missed when the relay is up
before the engine starts.  The events then take the same path as the torch and vLLM
engines' events: the worker's publisher, NATS, the routers' radix trees.

With HiCache, SGLang also announces what its host tier holds (``medium`` CPU_PINNED,
the same hashes and tokens as the GPU's pages): those events keep their tier (``host``;
``DISK`` would be ``disk``) and reach the routers on the tier subject.  SGLang's
external pools (``EXTERNAL``, e.g. Mooncake's) are not a tier of this worker's and are
dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import msgspec

from splitserve.contracts.block_events import KvEvent
from splitserve.contracts.kit.worker_metrics import KV_EVENT_DROPS
from splitserve.components.engines.zmq_relay import (
    free_loopback_port,
    relay_batches,
    removed_event,
    stored_event,
    tier_of,
)

log = logging.getLogger("splitserve.sglang")

__all__ = ["convert_batch", "free_loopback_port", "relay"]


def convert_batch(raw: bytes, page_size: int) -> list[KvEvent]:
    """Decode one msgpack ``KVEventBatch`` into BlockStored / BlockRemoved events.

    Each SGLang block is one page of ``page_size`` tokens; ``AllBlocksCleared`` has no
    counterpart in the project's events and is dropped.  Each event keeps its tier (the
    GPU's, the host's, the disk's; an external pool's events are dropped).  A stored
    block's ``lora_name`` (the adapter whose KV it holds) goes on the event, so the
    router keys its hashes by adapter.
    """
    from sglang.srt.disaggregation.kv_events import BlockRemoved as SBlockRemoved
    from sglang.srt.disaggregation.kv_events import BlockStored as SBlockStored
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(raw, type=KVEventBatch)
    events: list[KvEvent] = []
    for ev in batch.events:
        tier = tier_of(ev)
        if tier is None:  # an external pool's blocks: nothing this worker restores
            KV_EVENT_DROPS["external-tier"] += 1
            continue
        if isinstance(ev, SBlockStored):
            bs = ev.block_size or page_size
            n = len(ev.block_hashes)
            if bs != page_size or len(ev.token_ids) != n * bs:
                log.warning("skipping a BlockStored of %d tokens for %d blocks of %d "
                            "(page size %d)", len(ev.token_ids), n, bs, page_size)
                KV_EVENT_DROPS["token-count-mismatch"] += 1
                continue
            events.append(dataclasses.replace(stored_event(ev, bs, tier),
                                              lora_name=ev.lora_name))
        elif isinstance(ev, SBlockRemoved):
            events.append(removed_event(ev, tier))
    return events


async def relay(endpoint: str, page_size: int, sink: Callable[[list[KvEvent]], None],
                ready: asyncio.Event | None = None) -> None:
    """Listen on ``endpoint`` (``tcp://127.0.0.1:PORT``) and feed ``sink`` until
    cancelled; ``ready`` is set once the socket is bound (start the engine after)."""
    await relay_batches(endpoint, lambda raw: convert_batch(raw, page_size), sink, log, ready)
