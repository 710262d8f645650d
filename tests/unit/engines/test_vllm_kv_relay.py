"""vLLM's KV events (its real ZMQ publisher on loopback) become the project's events."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from splitserve.contracts.block_events import BlockRemoved, BlockStored
from splitserve.components.engines.vllm.kv_relay import (
    block_hash,
    convert_batch,
    free_loopback_port,
    relay,
)

pytestmark = pytest.mark.unit

BS = 4


def _batch():
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored

    return KVEventBatch(ts=time.time(), events=[
        VStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                token_ids=list(range(2 * BS)), block_size=BS, lora_id=None, medium=None,
                lora_name=None),
        VStored(block_hashes=[7], parent_block_hash=b"\x02" * 32,
                token_ids=list(range(BS)), block_size=BS, lora_id=None, medium=None,
                lora_name=None),
        VRemoved(block_hashes=[b"\x01" * 32], medium=None),
        AllBlocksCleared(),
    ])


def test_batch_converts_to_stored_and_removed_with_chained_hashes():
    raw = msgspec.msgpack.encode(_batch())
    stored, chained, removed = convert_batch(raw, BS)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.token_ids == tuple(range(2 * BS)) and stored.num_block_tokens == (BS, BS)
    assert stored.parent_hash is None and len(set(stored.block_hashes)) == 2
    assert chained.parent_hash == stored.block_hashes[1]  # same bytes, same int
    assert chained.block_hashes == (7,)
    assert removed.block_hashes == (stored.block_hashes[0],)


def test_hashes_are_signed_64_bit():
    for h in (b"\xff" * 32, 2**64 - 1, -5, 2**70 + 3):
        assert -(2**63) <= block_hash(h) < 2**63
    assert block_hash(-5) == -5


def test_partial_block_is_skipped():
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch

    bad = KVEventBatch(ts=0.0, events=[VStored(
        block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=BS,
        lora_id=None, medium=None, lora_name=None)])
    assert convert_batch(msgspec.msgpack.encode(bad), BS) == []


@pytest.mark.asyncio
async def test_relay_receives_from_vllms_publisher_on_loopback():
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    got: list = []
    ready = asyncio.Event()
    task = asyncio.create_task(relay(endpoint, BS, got.extend, ready))
    await ready.wait()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv-events")
    try:
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            pub.publish(_batch())  # messages sent before the connection are lost
            await asyncio.sleep(0.2)
    finally:
        pub.shutdown()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert got and isinstance(got[0], BlockStored)


def test_the_offload_tiers_blocks_keep_their_tier_and_stay_off_dynamos_publisher():
    """vLLM's native offloading publishes its host tier's blocks (``medium`` CPU) among the
    device's: they keep their tier, an external store's are dropped, and only the
    device's reach Dynamo's publisher (the host tier's go on the tier subject)."""
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch

    from splitserve.contracts.kit.hosting import publish_kv_events

    def stored(h, medium):
        return VStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(BS)),
                       block_size=BS, lora_id=None, medium=medium, lora_name=None)
    raw = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[
        stored(1, "GPU"), stored(1, "CPU"), VRemoved(block_hashes=[1], medium="GPU"),
        stored(2, "LMCACHE"), VRemoved(block_hashes=[1], medium="CPU")]))
    events = convert_batch(raw, BS)
    assert [(type(e).__name__, e.tier) for e in events] == [
        ("BlockStored", "device"), ("BlockStored", "host"), ("BlockRemoved", "device"),
        ("BlockRemoved", "host")]

    class Publisher:
        sent: list = []

        def publish_stored(self, *args, **kw):
            self.sent.append("stored")

        def publish_removed(self, hashes):
            self.sent.append("removed")
    pub = Publisher()
    publish_kv_events(pub, events)
    assert pub.sent == ["stored", "removed"]
