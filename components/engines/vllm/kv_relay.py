"""Relay of vLLM's KV events (its ZMQ publisher) into this project's KV event types.

vLLM's engine core publishes each step's ``KVEventBatch`` as a ZMQ multipart message
``(topic, 8-byte sequence, msgpack batch)`` to a loopback TCP socket; the worker turns
every ``BlockStored`` / ``BlockRemoved`` into the same events the torch engine emits and
hands them to the publisher that feeds the routers' radix trees.

vLLM's native offload tier (``kv_offloading_gib``) publishes its blocks on the same
stream with ``medium`` CPU: they keep that tier (``host``) and reach the routers on the
tier subject.  With self-describing events (switched on in ``to_engine_args``) each
offloaded chunk carries its blocks' tokens and parent; a chunk whose metadata vLLM no
longer had comes as a bare hash with no tokens, which the routers cannot key, and is
dropped here (counted in ``splitserve_worker_kv_events_dropped_total``).  Re-announced
blocks are counted by ``LowerTierLedger``.
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
    LowerTierLedger,
    block_hash,
    free_loopback_port,
    relay_batches,
    removed_event,
    stored_event,
    tier_of,
)

__all__ = ["block_hash", "convert_batch", "free_loopback_port", "relay"]

log = logging.getLogger("splitserve.vllm")

def convert_batch(raw: bytes, block_size: int) -> list[KvEvent]:
    """Decode one msgpack ``KVEventBatch`` into BlockStored / BlockRemoved events.

    ``AllBlocksCleared`` has no counterpart in the project's events and is dropped (the
    blocks age out of the router's tree through removal events instead).  A stored
    block's ``lora_name`` (the adapter its KV was computed with; vLLM's ``lora_id`` is
    deprecated) goes on the event, so the router keys its hashes by adapter.  Events of
    vLLM's offload tier (``medium`` CPU) carry that tier: the worker sends the device's
    through Dynamo's publisher and the offload tier's on the tier subject.  An offload
    store without tokens is dropped (see the module's docstring).
    """
    from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VBlockStored
    from vllm.distributed.kv_events import KVEventBatch

    batch = msgspec.msgpack.decode(raw, type=KVEventBatch)
    events: list[KvEvent] = []
    for ev in batch.events:
        tier = tier_of(ev)
        if tier is None:  # an external store's blocks: nothing a worker restores itself
            KV_EVENT_DROPS["external-tier"] += 1
            continue
        if isinstance(ev, VBlockStored):
            if tier != "device" and not ev.token_ids:
                KV_EVENT_DROPS["offload-without-tokens"] += 1
                continue
            bs = ev.block_size or block_size
            n = len(ev.block_hashes)
            if len(ev.token_ids) != n * bs:
                log.warning("skipping a BlockStored of %d tokens for %d blocks of %d",
                            len(ev.token_ids), n, bs)
                KV_EVENT_DROPS["token-count-mismatch"] += 1
                continue
            events.append(dataclasses.replace(stored_event(ev, bs, tier),
                                              lora_name=ev.lora_name))
        elif isinstance(ev, VBlockRemoved):
            events.append(removed_event(ev, tier))
    return events


async def relay(endpoint: str, block_size: int, sink: Callable[[list[KvEvent]], None],
                ready: asyncio.Event | None = None) -> None:
    """Subscribe to vLLM's publisher at ``endpoint`` and feed ``sink`` until cancelled.

    vLLM's publisher *connects* to a specific-host TCP endpoint (it binds only wildcard
    or ipc addresses), so this subscriber binds the loopback address and must be started
    before the engine: then no early event is missed and nothing listens beyond
    127.0.0.1.
    """
    ledger = LowerTierLedger()
    await relay_batches(endpoint, lambda raw: ledger.admit(convert_batch(raw, block_size)),
                        sink, log, ready)
