"""SGLang's real ZMQ KV-event publisher -> the SGLang adapter's relay -> Dynamo's event
plane on a real NATS -> the router's radix tree (real etcd and NATS, loopback only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from splitserve.infra.embedded import EmbeddedInfra
from tests.installed import needs_sglang

pytestmark = [pytest.mark.integration, needs_sglang]

PAGE = 4
NS = "sglkv"


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep


def _batch(tokens: list[int]):
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    n = len(tokens) // PAGE
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[1000 + i for i in range(n)], parent_block_hash=None,
        token_ids=tokens[:n * PAGE], block_size=PAGE, lora_id=None)])


@pytest.mark.timeout(120)
def test_sglang_events_reach_the_routers_radix_tree(infra, monkeypatch):
    monkeypatch.setenv("ETCD_ENDPOINTS", infra.etcd)
    monkeypatch.setenv("NATS_SERVER", infra.nats)
    asyncio.run(asyncio.wait_for(_run(infra.nats), 90))


async def _run(nats_url: str) -> None:
    from dynamo.llm import KvEventPublisher, compute_block_hash_for_seq
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

    from splitserve.components.engines.sglang.kv_relay import free_loopback_port, relay
    from splitserve.contracts.kit.hosting import publish_kv_events
    from splitserve.components.router.kv_index import KvEventIndex
    from splitserve.contracts.kit.component import make_runtime

    runtime = make_runtime(asyncio.get_running_loop(), "tcp")
    endpoint = runtime.endpoint(f"{NS}.worker.generate")
    publisher = KvEventPublisher(endpoint, kv_block_size=PAGE)
    index = KvEventIndex(NS, "Worker")
    await index.start(nats_url)

    zmq_endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    ready = asyncio.Event()
    relayed: list = []

    def sink(events):
        relayed.extend(events)
        publish_kv_events(publisher, events)

    task = asyncio.create_task(relay(zmq_endpoint, PAGE, sink, ready))
    await asyncio.wait_for(ready.wait(), 10)
    # SGLang's own publisher, configured the way the adapter configures the engine:
    # a concrete loopback host, so it connects to the relay.
    pub = ZmqEventPublisher(attn_dp_rank=0, endpoint=zmq_endpoint, topic="kv-events")
    tokens = list(range(1, 3 * PAGE + 1))
    local = compute_block_hash_for_seq(tokens, PAGE)
    try:
        deadline = time.monotonic() + 60
        overlap: dict = {}
        while time.monotonic() < deadline:
            if not relayed:
                pub.publish(_batch(tokens))  # sent before the connection: lost, resend
            overlap = index.overlap(local)
            if overlap:
                break
            await asyncio.sleep(0.2)
        assert relayed, "the relay received nothing from SGLang's publisher"
        assert overlap and max(overlap.values()) == 3, overlap
    finally:
        pub.shutdown()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await index.close()
        runtime.shutdown()
