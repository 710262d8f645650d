"""The torch engine's KV tiers on a worker's /metrics: occupancy, hits, write-backs,
restores and latency histograms read from a real tiered KV cache; every tier metric the
Grafana dashboard plots is one the worker exports; lower-tier events become numbered
envelopes, the pool's left to Dynamo's publisher."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.components.engines.torch_cpu.kv_cache import KVCacheManager, block_nbytes
from splitserve.components.engines.torch_cpu.kv_tiers import DiskTier, HostTier, TierChain
from splitserve.contracts.kit.tier_events import (
    TierEnvelopes,
    TierEventPublisher,
)
from splitserve.components.engines.torch_cpu.tier_metrics import TierMetrics
from splitserve.contracts import prometheus
from splitserve.contracts.block_events import BlockStored
from tests.fixtures.kv_blocks import compute

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
BS = 4
NBYTES = block_nbytes(BS, 2, 1, 2)


@pytest.fixture
def kv(tmp_path):
    disk = DiskTier(str(tmp_path), 8 * NBYTES)
    kv = KVCacheManager(4, BS, num_layers=2, num_kv_heads=1, head_dim=2,
                        tiers=TierChain([HostTier(3 * NBYTES), disk]))
    rng = random.Random(1)
    prompts = [list(range(s, s + 3 * BS)) + [999] for s in (1, 100, 200, 300, 400)]
    for i, p in enumerate(prompts):
        compute(kv, f"a{i}", p, rng)
    disk.flush()
    assert compute(kv, "again", prompts[0], rng) > 0  # restored from a tier
    disk.flush()  # the restore's write-backs too: the counters stop moving before reading
    yield kv
    kv.close()


def samples(kv, publisher=None):
    registry = CollectorRegistry()
    registry.register(TierMetrics(kv, publisher))
    return prometheus.parse(generate_latest(registry).decode())


def value(s, name, **labels) -> float:
    return prometheus.value(s, name, **labels)


def test_tier_metrics_are_the_tiers_counters(kv):
    s = samples(kv)
    stats = kv.tier_stats()
    for tier in ("host", "disk"):
        assert value(s, "splitserve_worker_kv_tier_bytes", tier=tier) == stats[tier].bytes_used
        assert value(s, "splitserve_worker_kv_tier_blocks", tier=tier) \
            == stats[tier].bytes_used // NBYTES
        assert value(s, "splitserve_worker_kv_tier_hits_total", tier=tier) == stats[tier].hits
        assert value(s, "splitserve_worker_kv_tier_writes_total", tier=tier) \
            == stats[tier].writes
        assert value(s, "splitserve_worker_kv_tier_evictions_total", tier=tier) \
            == stats[tier].evictions
        # one write observation per block written, one read per hit
        assert value(s, "splitserve_worker_kv_tier_write_seconds_count", tier=tier) \
            == stats[tier].writes
        assert value(s, "splitserve_worker_kv_tier_read_seconds_count", tier=tier) \
            == stats[tier].hits
    assert value(s, "splitserve_worker_kv_tier_capacity_blocks", tier="host") == 3
    assert value(s, "splitserve_worker_kv_tier_capacity_bytes", tier="disk") == 8 * NBYTES
    assert value(s, "splitserve_worker_kv_tier_blocks", tier="host") == 3  # full
    assert stats["host"].evictions > 0 and stats["disk"].writes > 0
    hits = stats["host"].hits + stats["disk"].hits
    assert hits > 0
    assert value(s, "splitserve_worker_kv_tier_moved_blocks_total",
                 direction="restored") == kv.num_restored_blocks == hits
    assert value(s, "splitserve_worker_kv_tier_moved_blocks_total",
                 direction="offloaded") == kv.num_offloaded_blocks > 0


def test_latency_buckets_are_cumulative(kv):
    s = samples(kv)
    buckets = sorted((float(dict(key)["le"]), v) for key, v in
                     s["splitserve_worker_kv_tier_write_seconds_bucket"].items()
                     if dict(key)["tier"] == "host")
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == kv.tier_stats()["host"].writes


def test_every_tier_metric_on_the_dashboard_is_exported(kv):
    dash = json.loads((ROOT / "deploy/grafana/dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs
            for m in re.findall(r"\bsplitserve_worker_kv_tier_[a-z_]+", e)}
    assert used, "the dashboard has no KV tier panel"
    publisher = TierEventPublisher(TierEnvelopes(1, kv.tier_capacity_blocks()), "subject")
    exported = {re.sub(r"_(bucket|count|sum)$", "", n) for n in samples(kv, publisher)}
    router = {"splitserve_router_kv_tier_event_gaps_total"}  # the router's (feeds.py)
    assert used - router <= exported, used - router - exported
    titles = [p["title"] for p in dash["panels"]]
    assert any(t.startswith("KV tiers") for t in titles), titles


def test_tier_envelopes_number_their_messages_and_leave_the_pool_out():
    env = TierEnvelopes(7, {"host": 3})
    pool = BlockStored((1,), None, (1, 2, 3, 4), (4,))
    host = BlockStored((1,), None, (1, 2, 3, 4), (4,), tier="host")
    assert env.envelope([pool]) is None and env.sequence == 0
    first = msgspec.msgpack.decode(env.envelope([pool, host]))
    second = msgspec.msgpack.decode(env.envelope([host]))
    assert (first["sequence"], second["sequence"]) == (0, 1)
    assert first["publisher_id"] == 7 and first["capacity"] == {"host": 3}
    events = msgspec.msgpack.decode(first["payload"])
    assert [e["storage_tier"] for e in events] == ["host_pinned"]


def test_tier_envelopes_carry_the_measured_restore_costs_and_send_a_change_alone():
    env = TierEnvelopes(7, {"host": 3, "disk": 9})
    host = BlockStored((1,), None, (1, 2, 3, 4), (4,), tier="host")
    first = msgspec.msgpack.decode(env.envelope([host], {"host": 0.5, "device": 9.0}))
    assert first["restore_ms_per_block"] == {"host": 0.5}  # lower tiers only
    assert env.envelope([], {"host": 0.52}) is None  # within 10%: nothing to say
    moved = msgspec.msgpack.decode(env.envelope([], {"host": 0.8}))
    assert moved["restore_ms_per_block"] == {"host": 0.8} and moved["sequence"] == 1
    assert msgspec.msgpack.decode(moved["payload"]) == []
    assert env.envelope([], {"host": 0.8, "disk": 4.0}) is not None  # a tier's first cost
    assert env.envelope([]) is None
