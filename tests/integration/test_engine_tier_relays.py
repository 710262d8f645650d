"""SGLang's and vLLM's own publishers announce their host tiers' blocks; the worker's
relay (``relay_kv_events``, as a worker hosting the engine runs it) sends the pool's
through Dynamo's publisher and the host tier's on this project's tier subject, over a
real NATS, into the router's index: the index credits each block at the tier the engine
announced it in, and a prefix hit per tier as a request sees it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from splitserve.infra.embedded import EmbeddedInfra
from tests.installed import needs_sglang, needs_vllm

pytestmark = [pytest.mark.integration]

NS = "enginetiers"
BS = 4
U64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep


class RelayedEngine:
    """What ``relay_kv_events`` reads of an engine: its info and its event relay (the
    engine's own ``run_kv_events`` is this relay on its loopback endpoint)."""

    def __init__(self, name: str, relay, endpoint: str) -> None:
        from splitserve.contracts.engine import EngineCapabilities, EngineInfo

        self.info = EngineInfo(name, BS, EngineCapabilities(
            local_prefill=True, pushes_kv=False, handoff_before_prefill=False,
            prefix_lookup=False, moves_kv=False, reports_failure=False),
            lower_tiers={"host": None})
        self._relay = relay
        self.endpoint = endpoint

    async def run_kv_events(self, sink, ready=None) -> None:
        await self._relay(self.endpoint, BS, sink, ready)


def sglang_batches(h):
    """Two pages on the GPU, both backed up to HiCache's host tier, the second then
    evicted from the GPU (SGLang's shapes and medium names)."""
    from sglang.srt.disaggregation.kv_events import (
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        StorageMedium,
    )

    def store(medium):
        return BlockStored(block_hashes=[h[0], h[1]], parent_block_hash=None,
                           token_ids=list(range(1, 2 * BS + 1)), block_size=BS, lora_id=None,
                           medium=medium)
    return [KVEventBatch(ts=time.time(), events=[
        store(StorageMedium.GPU.value), store(StorageMedium.CPU.value),
        BlockRemoved(block_hashes=[h[1]], medium=StorageMedium.GPU.value)])]


def vllm_batches(h):
    """Two blocks on the device, offloaded as a chunk of two, then announced again by an
    overlapping chunk and removed once (vLLM's self-describing offload events), the
    second evicted from the device."""
    from vllm.distributed.kv_events import MEDIUM_CPU, KVEventBatch
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored

    def store(medium):
        return VStored(block_hashes=[h[0], h[1]], parent_block_hash=None,
                       token_ids=list(range(1, 2 * BS + 1)), block_size=BS, lora_id=None,
                       medium=medium, lora_name=None)
    return [KVEventBatch(ts=time.time(), events=[
        store(None), store(MEDIUM_CPU), store(MEDIUM_CPU),
        VRemoved(block_hashes=[h[0], h[1]], medium=MEDIUM_CPU),
        VRemoved(block_hashes=[h[1]], medium=None)])]


def sglang_publisher(endpoint: str):
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, topic="kv-events")


def vllm_publisher(endpoint: str):
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, topic="kv-events")


def sglang_case():
    from splitserve.components.engines.sglang import kv_relay

    return kv_relay.relay, sglang_publisher, sglang_batches


def vllm_case():
    from splitserve.components.engines.vllm import kv_relay

    return kv_relay.relay, vllm_publisher, vllm_batches


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [pytest.param(sglang_case, marks=needs_sglang, id="sglang"),
                                  pytest.param(vllm_case, marks=needs_vllm, id="vllm")])
def test_an_engines_host_tier_reaches_the_routers_index(infra, monkeypatch, case):
    relay, publisher, batches = case()
    monkeypatch.setenv("ETCD_ENDPOINTS", infra.etcd)
    monkeypatch.setenv("NATS_SERVER", infra.nats)
    asyncio.run(asyncio.wait_for(_run(infra.nats, relay, publisher, batches), 100))


async def _run(nats_url: str, relay, make_publisher, batches) -> None:
    from splitserve.components.engines.zmq_relay import free_loopback_port
    from splitserve.components.router.kv_index import KvEventIndex
    from splitserve.contracts.kit.component import make_runtime

    runtime = make_runtime(asyncio.get_running_loop(), "tcp")
    index = KvEventIndex(NS, "Worker")
    await index.start(nats_url)
    engine = RelayedEngine("x", relay, f"tcp://127.0.0.1:{free_loopback_port()}")
    try:
        await _publish_and_check(index, engine, runtime.endpoint(f"{NS}.worker.generate"),
                                 make_publisher, batches)
    finally:
        await index.close()
        runtime.shutdown()


async def _publish_and_check(index, engine, endpoint, make_publisher, batches) -> None:
    from dynamo.llm import compute_block_hash_for_seq

    from splitserve.components.engines.zmq_relay import block_hash
    from splitserve.contracts.block_events import tier_event_subject
    from splitserve.contracts.kit.hosting import relay_kv_events

    worker_id = endpoint.connection_id()
    hashes = [1001, 1002]
    async with contextlib.AsyncExitStack() as stack:
        await relay_kv_events(engine, endpoint, stack,
                              tier_subject=tier_event_subject(NS, "Worker"))
        await asyncio.sleep(0.5)  # the index's subscriptions are in place
        pub = make_publisher(engine.endpoint)
        stack.callback(pub.shutdown)
        want = {"device": {block_hash(hashes[0]) & U64},
                "host": {block_hash(h) & U64 for h in hashes}, "disk": set()}

        def held() -> dict:
            return {t: {h & U64 for h in hs} for t, hs in index.tiers.held(worker_id).items()}
        deadline = time.monotonic() + 30
        while held() != want and time.monotonic() < deadline:
            # messages sent before the publisher's connection is up are lost: resend
            # until they arrive (the index holds each block once per tier)
            for batch in batches(hashes):
                pub.publish(batch)
            await asyncio.sleep(0.3)
        assert held() == want
        assert index.errors == 0 and index.tier_gaps == 0
        # The prompt's first block from the pool, its second from the host tier; the
        # pool's tree (Dynamo's) holds only the pool's block.
        seq = compute_block_hash_for_seq(list(range(1, 2 * BS + 1)), BS)
        assert index.overlap_by_tier(seq)[worker_id] == {"device": 1, "host": 1, "disk": 0}
        assert index.overlap(seq)[worker_id] == 1
