"""A real torch engine with a tiny pool, a host tier and a disk tier, driven through
eviction (device -> host -> disk -> dropped), its events published as a worker publishes
them (the pool's through Dynamo's KvEventPublisher, the lower tiers' on this project's
tier subject) over a real NATS, into the router's index: the index's per-tier view is
what the engine holds per tier, block for block, and each tier's capacity and measured
restore cost arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from splitserve.infra.embedded import EmbeddedInfra

pytestmark = [pytest.mark.integration]

NS = "kvtiers"
BS = 4  # tokens per block
POOL, HOST, DISK = 8, 6, 8  # blocks
U64 = (1 << 64) - 1


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep


def tiered_core(model_dir, disk_dir):
    from splitserve.components.engines.torch_cpu import EngineConfig, EngineCore, load_model
    from splitserve.components.engines.torch_cpu.kv_cache import block_nbytes

    model = load_model(str(model_dir))
    c = model.config
    nbytes = block_nbytes(BS, c.num_layers, c.num_kv_heads, c.head_dim)
    cfg = EngineConfig(block_size=BS, num_blocks=POOL, max_running=1,
                       host_kv_cache_gib=HOST * nbytes / 2**30,
                       disk_kv_cache_dir=str(disk_dir), disk_kv_cache_gib=DISK * nbytes / 2**30)
    return EngineCore(model.weights, model.config, cfg)


def unsigned(held: dict) -> dict:
    return {tier: {h & U64 for h in hashes} for tier, hashes in held.items()}


@pytest.mark.timeout(180)
def test_the_routers_index_follows_each_tier_through_eviction(infra, tiny_models, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("ETCD_ENDPOINTS", infra.etcd)
    monkeypatch.setenv("NATS_SERVER", infra.nats)
    core = tiered_core(tiny_models["llama"], tmp_path / "kv")
    try:
        asyncio.run(asyncio.wait_for(_run(core, infra.nats), 150))
    finally:
        core.close()


async def _run(core, nats_url: str) -> None:
    from dynamo.llm import KvEventPublisher, compute_block_hash_for_seq

    from splitserve.components.engines.torch_cpu.request import Request
    from splitserve.contracts.kit.tier_events import (
        TierEnvelopes,
        TierEventPublisher,
    )
    from splitserve.components.router.kv_index import KvEventIndex
    from splitserve.contracts.block_events import tier_event_subject
    from splitserve.contracts.kit.component import make_runtime
    from splitserve.contracts.kit.connect import close_nats, connect_nats
    from splitserve.contracts.kit.hosting import cancel_and_wait, publish_kv_events

    runtime = make_runtime(asyncio.get_running_loop(), "tcp")
    endpoint = runtime.endpoint(f"{NS}.worker.generate")
    worker_id = endpoint.connection_id()
    publisher = KvEventPublisher(endpoint, kv_block_size=BS)
    index = KvEventIndex(NS, "Worker")
    await index.start(nats_url)
    nc = await connect_nats(nats_url)
    tiers = TierEventPublisher(TierEnvelopes(worker_id, core.kv.tier_capacity_blocks()),
                               tier_event_subject(NS, "Worker"))
    sender = asyncio.create_task(tiers.run(nc))
    await asyncio.sleep(0.5)  # the subscriptions are in place before the first event
    try:
        # Twelve prompts of three full blocks (and a partial one), one after the other:
        # 36 cached blocks through a pool of 8, a host tier of 6 and a disk tier of 8.
        prompts = [[100 * i + t for t in range(1, 3 * BS + 2)] for i in range(1, 13)]
        for i, ids in enumerate(prompts):
            core.add_request(Request(f"r{i}", tuple(ids), max_tokens=1))
            while core.has_unfinished():
                core.step()
            events = core.drain_kv_events()
            publish_kv_events(publisher, events)
            tiers.submit(events)
        stats = core.kv.tier_stats()
        assert stats["host"].evictions > 0 and stats["disk"].evictions > 0, stats
        want = unsigned(core.kv.held_blocks())
        assert all(want[t] for t in ("device", "host", "disk")), want
        deadline = time.monotonic() + 30
        for _ in range(150):  # the events cross NATS asynchronously
            if index.tiers.held(worker_id) == want or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert index.tiers.held(worker_id) == want
        assert index.tier_gaps == 0 and index.errors == 0
        assert index.tiers.capacity[worker_id] == {"host": HOST, "disk": DISK}
        # Each prompt's prefix as a request sees it: the tier of every block the index
        # credits is the tier the engine holds it in (the pool's tree agrees on the pool).
        where = {h: t for t in ("disk", "host", "device") for h in want[t]}
        lower: list[int] = []  # a prompt whose prefix starts in a lower tier
        for ids in prompts:
            engine_hashes = chain(ids)
            expected = {"device": 0, "host": 0, "disk": 0}
            for h in engine_hashes:
                if h & U64 not in where:
                    break
                expected[where[h & U64]] += 1
            got = index.overlap_by_tier(compute_block_hash_for_seq(ids, BS))
            assert got.get(worker_id, {"device": 0, "host": 0, "disk": 0}) == expected
            assert index.overlap(compute_block_hash_for_seq(ids, BS)).get(worker_id, 0) \
                == expected["device"]
            if not lower and expected["device"] == 0 and expected["host"] + expected["disk"]:
                lower = ids
        # The prompt again: restored, not recomputed, and what a block's restore took
        # there reaches the index (admission prices a lower-tier hit at it).
        assert lower, "no prompt's prefix sits in a lower tier"
        core.add_request(Request("again", tuple(lower), max_tokens=1))
        while core.has_unfinished():
            core.step()
        costs = core.kv.restore_costs()
        assert costs and all(ms > 0 for ms in costs.values()), costs
        events = core.drain_kv_events()
        publish_kv_events(publisher, events)
        tiers.submit(events, costs)
        for _ in range(150):
            if index.tiers.restore_ms.get(worker_id) == costs:
                break
            await asyncio.sleep(0.2)
        assert index.tiers.restore_ms.get(worker_id) == costs
        assert tiers.failures == 0 and tiers.published > 0
        await _late_router_sees_the_same(core, nats_url, worker_id, publisher, tiers, index)
    finally:
        await cancel_and_wait(sender)
        await close_nats(nc, "test")
        await index.close()
        publisher.shutdown()
        runtime.shutdown()


async def _late_router_sees_the_same(core, nats_url, worker_id, publisher, tiers,
                                     index) -> None:
    """A router that starts now asks the workers to announce their caches; the worker
    (``serve_announce_requests``, as a torch worker runs it) announces every block in
    every tier on its usual streams, and the late router's view equals the engine's and
    the first router's, which the repeated stores leave unchanged."""
    import contextlib

    from dynamo.llm import compute_block_hash_for_seq

    from splitserve.components.router.kv_index import KvEventIndex
    from splitserve.contracts.block_events import kv_announce_subject
    from splitserve.contracts.kit.hosting import publish_kv_events, serve_announce_requests

    def announce() -> None:  # what EngineRunner.announce_cache delivers
        events = core.announce_kv_events()
        publish_kv_events(publisher, events)
        tiers.submit(events)

    want = unsigned(core.kv.held_blocks())
    before = index.overlap(compute_block_hash_for_seq(list(range(1, 3 * BS + 2)), BS))
    late = KvEventIndex(NS, "Worker")
    async with contextlib.AsyncExitStack() as stack:
        await serve_announce_requests(nats_url, kv_announce_subject(NS, "Worker"), worker_id,
                                      announce, stack)
        await asyncio.sleep(0.3)  # the worker listens before the router asks
        await late.start(nats_url)
        try:
            for _ in range(150):
                if unsigned(late.tiers.held(worker_id)) == want:
                    break
                await asyncio.sleep(0.2)
            assert unsigned(late.tiers.held(worker_id)) == want
            assert late.announce_requests == 1 and late.errors == 0
            assert unsigned(index.tiers.held(worker_id)) == want  # unchanged by repeats
            for i in range(1, 13):
                seq = compute_block_hash_for_seq([100 * i + t for t in range(1, 3 * BS + 2)],
                                                 BS)
                assert late.overlap_by_tier(seq) == index.overlap_by_tier(seq)
                assert late.overlap(seq) == index.overlap(seq)
            assert index.overlap(compute_block_hash_for_seq(list(range(1, 3 * BS + 2)), BS)) \
                == before
        finally:
            await late.close()


def chain(ids: list[int]) -> list[int]:
    from splitserve.contracts.block_events import hash_block

    out: list[int] = []
    for i in range(len(ids) // BS):
        out.append(hash_block(out[-1] if out else None, ids[i * BS:(i + 1) * BS]))
    return out
