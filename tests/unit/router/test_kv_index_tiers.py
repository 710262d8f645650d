"""The router's prefix index across KV tiers: events of each tier, a block moving down
the tiers, events from before tiers, weighted overlap, and a real torch KV cache with
host and disk tiers whose drained events keep the index equal to what it holds."""

from __future__ import annotations

import random
import shutil
import sys
import threading

import pytest
from dynamo.llm import compute_block_hash_for_seq

from splitserve.components.engines.torch_cpu.kv_cache import KVCacheManager, block_nbytes
from splitserve.components.engines.torch_cpu.kv_tiers import DiskTier, HostTier, TierChain
from splitserve.components.router.kv_index import KvEventIndex
from splitserve.contracts.block_events import (
    TIERS,
    BlockRemoved,
    BlockStored,
    KvEvent,
    hash_block,
)
from splitserve.contracts.kv_events import KvEventEncoder
from tests.fixtures.kv_blocks import compute

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(1, 17))  # four full blocks
U64 = (1 << 64) - 1


def chain(tokens: list[int], lora: str | None = None) -> list[int]:
    """The engine's chained hash of each full block of ``tokens``."""
    hashes: list[int] = []
    for i in range(len(tokens) // BS):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 tokens[i * BS:(i + 1) * BS], lora))
    return hashes


H = chain(PROMPT)


def lookup(tokens: list[int], lora: str | None = None) -> list[int]:
    """A request's lookup keys, as the router computes them."""
    return compute_block_hash_for_seq(tokens, BS, lora_name=lora)


def stored(first: int, last: int, tier: str = "device") -> BlockStored:
    """PROMPT's blocks ``first..last`` stored in ``tier``."""
    return BlockStored(block_hashes=tuple(H[first:last + 1]),
                       parent_hash=H[first - 1] if first else None,
                       token_ids=tuple(PROMPT[first * BS:(last + 1) * BS]),
                       num_block_tokens=(BS,) * (last + 1 - first), tier=tier)


def removed(*blocks: int, tier: str = "device") -> BlockRemoved:
    return BlockRemoved(tuple(H[b] for b in blocks), tier=tier)


def counts(device: int = 0, host: int = 0, disk: int = 0) -> dict[str, int]:
    return {"device": device, "host": host, "disk": disk}


class Feed:
    """A KvEventIndex fed straight through its apply path, one encoder per worker."""

    def __init__(self) -> None:
        self.index = KvEventIndex("ns", "worker")
        self.encoders: dict[int, KvEventEncoder] = {}

    def send(self, worker: int, *events: KvEvent) -> None:
        encoder = self.encoders.setdefault(worker, KvEventEncoder(worker))
        assert self.index.apply(encoder.encode(events)) == len(events)


# ---- events of each tier ------------------------------------------------------------
@pytest.mark.parametrize(("events", "expected"), [
    ({1: [stored(0, 3)]}, {1: counts(device=4)}),
    ({1: [stored(0, 1), stored(2, 2, "host"), stored(3, 3, "disk")]},
     {1: counts(device=2, host=1, disk=1)}),
    # A block stored in a tier before its parent is still reached through the parent.
    ({1: [stored(3, 3, "disk"), stored(2, 2, "host"), stored(0, 1, "host")]},
     {1: counts(host=3, disk=1)}),
    # The prefix ends at the first block no tier holds.
    ({1: [stored(0, 0), stored(2, 3, "host")]}, {1: counts(device=1)}),
    ({1: [stored(1, 3, "host")]}, {}),
    # Device blocks after a host block still count: the worker reads all of them back.
    ({1: [stored(0, 3), removed(1), stored(1, 1, "host")]}, {1: counts(device=3, host=1)}),
    ({1: [stored(0, 1)], 2: [stored(0, 0, "host"), stored(1, 2, "disk")]},
     {1: counts(device=2), 2: counts(host=1, disk=2)}),
])
def test_events_of_each_tier_give_the_per_tier_overlap(events, expected):
    feed = Feed()
    for worker, evs in events.items():
        feed.send(worker, *evs)
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == expected


def test_overlap_stays_the_device_tree_and_ignores_lower_tiers():
    feed = Feed()
    feed.send(1, stored(0, 1), stored(2, 3, "host"))
    feed.send(2, stored(0, 3, "disk"))
    assert feed.index.overlap(lookup(PROMPT)) == {1: 2}
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == {1: counts(device=2, host=2),
                                                         2: counts(disk=4)}


def test_a_block_moved_down_the_tiers_counts_once_at_its_best_tier():
    feed = Feed()
    steps: list[tuple[list[KvEvent], dict]] = [
        ([stored(0, 3)], counts(device=4)),
        ([removed(3), stored(3, 3, "host")], counts(device=3, host=1)),
        ([removed(3, tier="host"), stored(3, 3, "disk")], counts(device=3, disk=1)),
        # Copied back into the pool, the disk keeping its copy: device, counted once.
        ([stored(3, 3)], counts(device=4)),
        ([removed(3)], counts(device=3, disk=1)),
        ([removed(3, tier="disk")], counts(device=3)),
        # The first block down to host: the rest are still read, after it.
        ([removed(0), stored(0, 0, "host")], counts(device=2, host=1)),
        ([stored(0, 0, "disk")], counts(device=2, host=1)),  # in two tiers: the faster
        ([removed(0, tier="host")], counts(device=2, disk=1)),
        ([removed(0, tier="disk")], None),  # gone: no prefix left at all
    ]
    for events, expected in steps:
        feed.send(7, *events)
        got = feed.index.overlap_by_tier(lookup(PROMPT))
        assert got == ({} if expected is None else {7: expected}), events
        assert sum(got.get(7, counts()).values()) <= len(H)


def test_events_without_a_tier_are_the_device_tier():
    assert BlockStored((1,), None, (1, 2, 3, 4), (4,)).tier == "device"
    assert BlockRemoved((1,)).tier == "device"
    encoded = KvEventEncoder(3).encode([stored(0, 3), removed(3, tier="host")])
    del encoded[0]["storage_tier"]  # as a publisher from before tiers sends it
    feed = Feed()
    assert feed.index.apply(encoded) == 2
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == {3: counts(device=4)}
    assert feed.index.overlap(lookup(PROMPT)) == {3: 4}


def test_a_tier_the_index_does_not_keep_is_skipped():
    (event,) = KvEventEncoder(3).encode([stored(0, 3)])
    feed = Feed()
    assert feed.index.apply([{**event, "storage_tier": "external"}]) == 0
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == {}
    assert feed.index.overlap(lookup(PROMPT)) == {}


def test_wire_tier_names_are_dynamos():
    encoded = KvEventEncoder(1).encode([stored(0, 0, tier) for tier in TIERS])
    assert [e["storage_tier"] for e in encoded] == ["device", "host_pinned", "disk"]
    assert [e["event"]["event_id"] for e in encoded] == [0, 1, 2]


@pytest.mark.parametrize(("weights", "expected"), [
    ({"host": 0.75, "disk": 0.25}, {1: 2 + 0.75 + 0.25, 2: 0.75 * 2}),
    ({}, {1: 2.0, 2: 0.0}),  # a tier left out weighs nothing
    ({"device": 0.5, "host": 1.0, "disk": 1.0}, {1: 1.0 + 2, 2: 2.0}),
])
def test_weighted_overlap_weighs_each_tier(weights, expected):
    feed = Feed()
    feed.send(1, stored(0, 1), stored(2, 2, "host"), stored(3, 3, "disk"))
    feed.send(2, stored(0, 1, "host"))
    assert feed.index.weighted_overlap(lookup(PROMPT), weights) == pytest.approx(expected)


@pytest.mark.parametrize("weights", [{"host": -0.1}, {"disk": float("nan")}, {"gpu": 1.0}])
def test_weighted_overlap_refuses_bad_weights(weights):
    with pytest.raises(ValueError, match=r"weights\["):
        KvEventIndex("ns", "worker").weighted_overlap(lookup(PROMPT), weights)


def test_a_worker_that_leaves_is_forgotten_in_every_tier():
    feed = Feed()
    feed.send(1, stored(0, 1), stored(2, 3, "disk"))
    feed.send(2, stored(0, 0, "host"))
    feed.index.sync_workers({1, 2})
    feed.index.sync_workers({2})
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == {2: counts(host=1)}
    assert feed.index.tiers.held(1) == {tier: set() for tier in TIERS}


def test_block_counts_follow_moves_drops_and_departures():
    """/metrics' per-tier block counts are kept as events arrive (they are read from the
    metrics server's thread, which must not walk dictionaries the events change)."""
    feed = Feed()
    index = feed.index.tiers
    feed.index.sync_workers({1, 2})
    feed.send(1, stored(0, 3), stored(2, 3, "host"), stored(3, 3, "disk"))
    feed.send(2, stored(0, 1, "host"))
    assert index.block_counts() == counts(device=4, host=4, disk=1)
    feed.send(1, removed(2, 3), stored(0, 0))  # off the pool; a block stored again
    assert index.block_counts() == counts(device=2, host=4, disk=1)
    feed.send(1, removed(2, tier="host"), removed(2, tier="host"))  # the second: gone
    assert index.block_counts() == counts(device=2, host=3, disk=1)
    index.drop_tiers(1, ["host", "disk"])
    assert index.block_counts() == counts(device=2, host=2)
    feed.index.sync_workers({1})
    assert index.block_counts() == counts(device=2)


def test_block_counts_read_from_another_thread_while_events_apply():
    """The metrics server's thread reads the counts while the event loop applies events;
    walking the index's dictionaries there failed with "dictionary changed size during
    iteration" (a 500 on /metrics)."""
    feed = Feed()
    feed.index.sync_workers({1})
    prompt = list(range(1, 4 * 64 + 1))
    hashes = chain(prompt)
    blocks = [BlockStored(block_hashes=(hashes[i],), parent_hash=hashes[i - 1] if i else None,
                          token_ids=tuple(prompt[i * BS:(i + 1) * BS]), num_block_tokens=(BS,))
              for i in range(len(hashes))]
    done = threading.Event()
    errors: list[BaseException] = []

    def apply() -> None:
        try:
            for _ in range(40):
                for block in blocks:
                    feed.send(1, block)
                feed.send(1, BlockRemoved(tuple(hashes)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        writer = threading.Thread(target=apply)
        writer.start()
        reads = 0
        while not done.is_set():
            total = sum(feed.index.tiers.block_counts().values())
            assert 0 <= total <= len(hashes)
            reads += 1
        writer.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and reads > 0
    assert feed.index.tiers.block_counts() == counts()


# ---- a real KV cache with tiers -------------------------------------------------------
NBYTES = block_nbytes(BS, 2, 1, 2)


def expected_by_tier(held: dict[str, set[int]], tokens: list[int],
                     lora: str | None) -> dict[str, int]:
    """What a worker holding ``held`` reads back of ``tokens``' prefix, per tier: walk
    the blocks until none holds one, each at the first tier that has it."""
    out = counts()
    for h in chain(tokens, lora):
        tier = next((t for t in TIERS if h in held.get(t, ())), None)
        if tier is None:
            break
        out[tier] += 1
    return out


def test_index_mirrors_a_tiered_kv_cache_block_for_block(tmp_path):
    disk = DiskTier(str(tmp_path), 6 * NBYTES)
    kv = KVCacheManager(6, BS, num_layers=2, num_kv_heads=1, head_dim=2,
                        tiers=TierChain([HostTier(3 * NBYTES), disk]))
    feed = Feed()
    rng = random.Random(5)
    # Prompts sharing prefixes, each one token past whole blocks so that every full block
    # can be reused; an adapter's blocks, unloaded halfway.
    base = [list(range(s, s + 4 * BS)) + [999] for s in (1, 100, 200, 300)]
    prompts = [(p[:n * BS] + [999], None) for p in base for n in (2, 4)]
    prompts += [(base[0], "ad"), (base[1][:3 * BS] + [5], None)]
    schedule = prompts + rng.sample(prompts, len(prompts)) + prompts[::-1]
    worker = 11
    seen_tiers: set[str] = set()
    for step, (tokens, lora) in enumerate(schedule):
        compute(kv, f"s{step}", tokens, rng, lora)
        if step == len(schedule) // 2:
            kv.forget_lora("ad")
        feed.send(worker, *kv.drain_events())
        held = kv.held_blocks()
        assert held.keys() == set(TIERS)
        unsigned = {tier: {h & U64 for h in hashes} for tier, hashes in held.items()}
        assert feed.index.tiers.held(worker) == unsigned, step
        assert feed.index.tiers.block_counts() == {t: len(unsigned[t]) for t in TIERS}, step
        seen_tiers |= {tier for tier, hashes in held.items() if hashes}
        for query, query_lora in prompts:
            want = expected_by_tier(held, query, query_lora)
            got = feed.index.overlap_by_tier(lookup(query, query_lora))
            assert got == ({worker: want} if any(want.values()) else {}), (step, query)
    assert seen_tiers == set(TIERS)  # the run reached every tier
    stats = kv.tier_stats()
    assert stats["host"].evictions > 0 and stats["disk"].evictions > 0
    assert kv.num_restored_blocks > 0
    kv.close()


def test_a_disk_write_that_fails_is_removed_from_the_index(tmp_path):
    disk = DiskTier(str(tmp_path), 8 * NBYTES)
    kv = KVCacheManager(3, BS, num_layers=2, num_kv_heads=1, head_dim=2,
                        tiers=TierChain([disk]))
    feed = Feed()
    rng = random.Random(1)
    compute(kv, "a", PROMPT[:9], rng)  # two blocks, both cached
    shutil.rmtree(disk.directory)  # the writer cannot create its files
    compute(kv, "b", list(range(50, 59)), rng)  # takes the whole pool: they go to disk
    disk.flush()
    assert disk.stats.errors > 0
    events = kv.drain_events()
    assert [e for e in events if e.tier == "disk" and isinstance(e, BlockRemoved)]
    feed.send(1, *events)
    assert kv.held_blocks()["disk"] == set()
    assert feed.index.tiers.held(1)["disk"] == set()
    assert feed.index.overlap_by_tier(lookup(PROMPT)) == {}
    kv.close()


def test_only_pool_events_go_to_dynamos_publisher():
    """Dynamo's publisher has no tier: a host or disk tier's events must not reach it (the
    routers would read them as pool blocks)."""
    from splitserve.contracts.block_events import BlockRemoved, BlockStored
    from splitserve.contracts.kit.hosting import publish_kv_events

    class Publisher:
        def __init__(self):
            self.sent = []

        def publish_stored(self, tokens, sizes, hashes, parent, lora_name=None):
            self.sent.append(("stored", tuple(hashes)))

        def publish_removed(self, hashes):
            self.sent.append(("removed", tuple(hashes)))

    pub = Publisher()
    publish_kv_events(pub, [
        BlockStored((1,), None, (5, 6), (2,)), BlockRemoved((1,)),
        BlockStored((1,), None, (5, 6), (2,), tier="host"), BlockRemoved((1,), tier="host"),
        BlockStored((1,), None, (5, 6), (2,), tier="disk")])
    assert pub.sent == [("stored", (1,)), ("removed", (1,))]
