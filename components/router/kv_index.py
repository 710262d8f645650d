"""The router's prefix index: which blocks each worker holds in each KV tier, kept
current from the workers' KV events on NATS.

Dynamo 1.6.1's wheel exposes ``RadixTree`` but not ``KvIndexer``, so the router
subscribes to the workers' ``kv-events`` subject on the event plane itself and applies
each event to its own index.  Workers that leave discovery are removed from it.

``TierBlockIndex`` keys blocks as Dynamo's tree does (a block is found by its parent's
hash and the hash of its own tokens) and follows a request's prefix block by block:

- ``overlap``: the device tier's prefix per worker, the blocks Dynamo's ``RadixTree``
  would score (its longest prefix held in the pool; ``tests/unit/router/
  test_kv_index_vs_radix_tree.py`` checks the two agree on random event streams).
  Dynamo's tree answers each call from a thread of its own, two thread hand-offs per
  event and per lookup on the frontend's hot path; this walk is the same dictionary
  lookups in process.
- ``overlap_by_tier``, ``weighted_overlap``: the prefix through whichever tier holds
  each block, the way a worker restores it.  Blocks reach a lower tier one at a time,
  usually a sequence's last block first, so a block is reachable whichever tier its
  parent sits in.
- ``prefix_hits``: all three from one walk (what the router asks per request).

The pool's events come through Dynamo's publisher on its ``kv-events`` subject; the
lower tiers' (``host``, ``disk``) on this project's ``tier_event_subject``, one stream
per worker with a sequence number and each tier's capacity (``apply_tier_message``).  A
message missed on that stream (a gap in the sequence) drops the worker's lower-tier
blocks from the index, logged and counted (``tier_gaps``), and asks that worker to
announce its cache again: they are credited again as the worker reports them, never
credited from a stale view.

A router that starts after the workers asks every worker to announce its whole cache
(``kv_announce_subject``): the workers that can (the torch engine's) re-announce every
block they hold, in each tier, on their usual streams.  Re-announced blocks a router
already holds change nothing there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from splitserve.contracts.block_events import (
    LOWER_TIERS,
    TIER_EVENTS_TOPIC,
    TIERS,
    Tier,
    kv_announce_subject,
    tier_event_subject,
)
from splitserve.contracts.kit.connect import close_nats
from splitserve.contracts.kv_events import (
    KV_EVENTS,
    apply_kv_events,
    decode_envelope,
    event_subject,
    event_tier,
)

log = logging.getLogger("splitserve.router")

_BIT = {tier: 1 << i for i, tier in enumerate(TIERS)}
_DEVICE = _BIT["device"]


class _RankBlocks:
    """One (worker, dp rank)'s blocks: how each links to its parent, and its tiers."""

    def __init__(self) -> None:
        # (parent's hash or None, hash of the block's own tokens) -> the block's hash
        self.child: dict[tuple[int | None, int], int] = {}
        self.link: dict[int, tuple[int | None, int]] = {}  # block hash -> its key above
        self.tiers: dict[int, int] = {}  # block hash -> bit mask of the tiers holding it
        # Blocks held per tier (``TIERS`` order), kept as the masks change, so that
        # /metrics (served from a thread of its own) reads numbers, never these dicts.
        self.counts: list[int] = [0] * len(TIERS)

    def _count(self, bits: int, step: int) -> None:
        while bits:
            low = bits & -bits
            self.counts[low.bit_length() - 1] += step
            bits ^= low

    def store(self, bit: int, parent: int | None, blocks: Sequence[Mapping[str, Any]]) -> None:
        for block in blocks:
            h, key = int(block["block_hash"]), (parent, int(block["tokens_hash"]))
            old = self.link.get(h)
            if old is not None and old != key and self.child.get(old) == h:
                del self.child[old]
            self.child[key] = h
            self.link[h] = key
            mask = self.tiers.get(h, 0)
            self._count(bit & ~mask, 1)
            self.tiers[h] = mask | bit
            parent = h

    def drop_tiers(self, bits: int) -> None:
        """Forget every block's place in the tiers of ``bits`` (a gap in their events)."""
        for h in [h for h, mask in self.tiers.items() if mask & bits]:
            self.remove(bits, [h])

    def remove(self, bit: int, hashes: Sequence[int]) -> None:
        for h in map(int, hashes):
            held = self.tiers.get(h, 0)
            self._count(held & bit, -1)
            mask = held & ~bit
            if mask:
                self.tiers[h] = mask
            elif self.tiers.pop(h, None) is not None:
                key = self.link.pop(h)
                if self.child.get(key) == h:
                    del self.child[key]
                # Its children stay linked under its hash: stored again, it reaches them.

    def prefix(self, local_hashes: Sequence[int]) -> tuple[list[int], int]:
        """Blocks of the prefix readable here, per tier (``TIERS`` order): each block
        counted once, at the fastest tier holding it; stops at the first block no tier
        holds, as a worker's restore does.  And the device tier's own prefix: the
        leading blocks the pool holds (Dynamo's tree's score)."""
        counts = [0] * len(TIERS)
        device = -1  # the pool's prefix, until a block outside it
        parent: int | None = None
        for i, local in enumerate(local_hashes):
            h = self.child.get((parent, local))
            mask = 0 if h is None else self.tiers.get(h, 0)
            if not mask:
                break
            if device < 0 and not mask & _DEVICE:
                device = i
            counts[(mask & -mask).bit_length() - 1] += 1
            parent = h
        return counts, sum(counts) if device < 0 else device


class TierBlockIndex:
    """Which blocks each worker holds in each tier; pure data, no I/O.

    Fed by ``apply`` (the ``TierSink`` of ``apply_kv_events``) with the inner KV events
    of every tier.  Keys are those of Dynamo's tree: a block is found by its parent's
    hash and the hash of its own tokens (a request's ``compute_block_hash_for_seq``), so
    a block is reachable whichever tier its parent sits in.
    """

    def __init__(self) -> None:
        self._ranks: dict[tuple[int, int], _RankBlocks] = {}
        self.capacity: dict[int, dict[Tier, int]] = {}
        """Per worker, the blocks each of its lower tiers can hold (as it reports them)."""
        self.restore_ms: dict[int, dict[Tier, float]] = {}
        """Per worker, what restoring one block from each lower tier measurably takes
        there, ms (as it reports it; a tier that has restored nothing yet is absent)."""

    def apply(self, worker_id: int, tier: Tier, event: Mapping[str, Any]) -> None:
        """Apply one inner event (``{event_id, data, dp_rank}``) of ``worker_id``'s
        ``tier``; a clear drops the rank's blocks in every tier, as Dynamo's does."""
        rank = (worker_id, int(event.get("dp_rank", 0)))
        data = event["data"]
        if data == "cleared":
            self._ranks.pop(rank, None)
            return
        blocks = self._ranks.setdefault(rank, _RankBlocks())
        if "stored" in data:
            stored = data["stored"]
            parent = stored.get("parent_hash")
            blocks.store(_BIT[tier], None if parent is None else int(parent), stored["blocks"])
        elif "removed" in data:
            blocks.remove(_BIT[tier], data["removed"]["block_hashes"])

    def remove_worker(self, worker_id: int) -> None:
        """Forget every block of ``worker_id`` (it left discovery)."""
        for rank in [r for r in self._ranks if r[0] == worker_id]:
            del self._ranks[rank]
        self.capacity.pop(worker_id, None)
        self.restore_ms.pop(worker_id, None)

    def drop_tiers(self, worker_id: int, tiers: Sequence[Tier]) -> None:
        """Forget where ``worker_id``'s blocks sit in ``tiers`` (their events were lost);
        its blocks in the other tiers stay."""
        bits = 0
        for tier in tiers:
            bits |= _BIT[tier]
        for (wid, _), blocks in self._ranks.items():
            if wid == worker_id:
                blocks.drop_tiers(bits)

    def occupancy(self, worker_id: int) -> dict[Tier, tuple[int, int | None]]:
        """Per tier, (blocks ``worker_id`` holds there, its capacity or None when not
        reported: the pool's comes with the worker's load reports, not here)."""
        held = self.held(worker_id)
        cap = self.capacity.get(worker_id, {})
        return {tier: (len(held[tier]), cap.get(tier)) for tier in TIERS}

    def block_counts(self) -> dict[Tier, int]:
        """Blocks indexed per tier, over every worker (a block in two tiers counts in
        both).  Safe to call from another thread than the one applying events (the
        metrics server's): it copies the list of ranks, then reads each rank's counts."""
        counts = [0] * len(TIERS)
        for blocks in list(self._ranks.values()):
            for i, n in enumerate(blocks.counts):
                counts[i] += n
        return dict(zip(TIERS, counts, strict=True))

    def held(self, worker_id: int) -> dict[Tier, set[int]]:
        """The block hashes (unsigned, as on the wire) ``worker_id`` holds, per tier."""
        out: dict[Tier, set[int]] = {tier: set() for tier in TIERS}
        for (wid, _), blocks in self._ranks.items():
            if wid == worker_id:
                for h, mask in blocks.tiers.items():
                    for tier in TIERS:
                        if mask & _BIT[tier]:
                            out[tier].add(h)
        return out

    def rank_prefixes(self, local_hashes: Sequence[int]
                      ) -> list[tuple[int, list[int], int]]:
        """(worker, blocks per tier in ``TIERS`` order, the device tier's own prefix) of
        every rank with a prefix hit."""
        hits = []
        for (wid, _), blocks in self._ranks.items():
            counts, device = blocks.prefix(local_hashes)
            if any(counts):
                hits.append((wid, counts, device))
        return hits


class KvEventIndex:
    """Prefix overlap per worker and tier, kept current from KV events."""

    def __init__(self, namespace: str, component: str) -> None:
        self.tiers = TierBlockIndex()
        self.subject = event_subject(namespace, component.lower(), KV_EVENTS)
        self.tier_subject = tier_event_subject(namespace, component)
        self.announce_subject = kv_announce_subject(namespace, component)
        self.announce_requests = 0
        """Requests sent for workers to announce their caches again."""
        self._gapped: set[int] = set()  # workers whose tier stream had a gap, to ask
        self.known: set[int] = set()
        self.applied = 0
        self.errors = 0
        self.tier_messages = 0
        """Lower-tier event messages applied."""
        self.tier_gaps = 0
        """Lower-tier event messages found missing (each drops a worker's lower tiers)."""
        self._sequence: dict[int, int] = {}  # publisher -> the last sequence number seen
        self._nc = None

    async def start(self, nats_url: str) -> None:
        """Subscribe to the workers' KV events (call once at startup)."""
        from splitserve.contracts.kit.connect import connect_nats

        self._nc = await connect_nats(nats_url, name="splitserve-router-kv",
                                      max_reconnect_attempts=-1)
        await self._nc.subscribe(self.subject, cb=self._on_msg)
        await self._nc.subscribe(self.tier_subject, cb=self._on_tier_msg)
        await self._nc.flush()  # subscribed before the workers answer
        await self.request_announce(None)

    async def request_announce(self, worker_id: int | None) -> None:
        """Ask ``worker_id`` (None: every worker) to announce its whole KV cache again;
        a failure is logged (the index then learns from new events only)."""
        import json

        try:
            await self._nc.publish(self.announce_subject,
                                   json.dumps({"worker_id": worker_id}).encode())
            self.announce_requests += 1
        except Exception as exc:  # noqa: BLE001 - the index still follows new events
            log.warning("could not ask workers to announce their KV caches: %s", exc)

    async def _on_msg(self, msg) -> None:
        try:
            topic, payload = decode_envelope(msg.data)
            if topic == KV_EVENTS:
                self.apply(payload)
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the index
            self.errors += 1
            log.warning("could not apply KV event: %s", exc)

    async def _on_tier_msg(self, msg) -> None:
        try:
            self.apply_tier_message(msg.data)
        except Exception as exc:  # noqa: BLE001 - one bad message must not stop the index
            self.errors += 1
            log.warning("could not apply KV tier event: %s", exc)
        while self._gapped:
            await self.request_announce(self._gapped.pop())

    def apply_tier_message(self, data: bytes) -> int:
        """Apply one envelope from ``tier_subject`` (called per message, and by anything
        that has one without NATS): a worker's lower-tier events, capacities and measured
        restore costs (kept until it reports them again).  A
        sequence number that skips ahead drops that worker's lower tiers first (they
        would be stale), logged and counted in ``tier_gaps``; one that goes back (the
        publisher started over) is taken as a new stream.  Returns the events applied."""
        env = msgspec.msgpack.decode(data)
        if env.get("topic") != TIER_EVENTS_TOPIC:
            return 0
        wid, seq = int(env["publisher_id"]), int(env["sequence"])
        last = self._sequence.get(wid)
        if last is not None and seq != last + 1:
            if seq > last + 1:
                self.tier_gaps += 1
                self._gapped.add(wid)
                log.warning("worker %x: %d KV tier event message(s) lost; its host and "
                            "disk blocks are dropped from the index until reported again",
                            wid, seq - last - 1)
            self.tiers.drop_tiers(wid, LOWER_TIERS)
        self._sequence[wid] = seq
        self.tiers.capacity[wid] = {t: int(n) for t, n in env.get("capacity", {}).items()
                                    if t in LOWER_TIERS}
        costs = {t: float(ms) for t, ms in env.get("restore_ms_per_block", {}).items()
                 if t in LOWER_TIERS and math.isfinite(float(ms)) and float(ms) >= 0}
        if costs:
            self.tiers.restore_ms[wid] = costs
        events = [ev for ev in msgspec.msgpack.decode(env["payload"])
                  if event_tier(ev) in LOWER_TIERS]  # the pool's come through Dynamo's
        for ev in events:
            self.tiers.apply(int(ev["worker_id"]), event_tier(ev), ev["event"])
        self.tier_messages += 1
        return len(events)

    def apply(self, payload: list[dict]) -> int:
        """Apply one decoded ``kv-events`` payload (called per message, and by anything
        that has events without NATS); returns how many events were applied."""
        n = apply_kv_events(None, payload, self.tiers)
        self.applied += n
        return n

    def overlap(self, block_hashes: list[int]) -> dict[int, int]:
        """Cached prefix blocks per worker for the request's local block hashes: the
        device tier's prefix, as Dynamo's tree scores it.  A worker with several ranks
        reports its best rank; workers without a hit are left out."""
        return self.prefix_hits(block_hashes, {})[0]

    def overlap_by_tier(self, block_hashes: list[int]) -> dict[int, dict[Tier, int]]:
        """Per worker, the prefix blocks it could read instead of computing, by tier.

        Each block of the longest prefix the worker holds in any tier counts once, at
        the fastest tier holding it (a block in the pool and in host memory is device);
        every tier appears, 0 included.  A worker with several ranks reports the rank
        with the most blocks, then the most device blocks, then host.  Workers without
        a hit are left out.
        """
        return self.prefix_hits(block_hashes, {})[1]

    def weighted_overlap(self, block_hashes: list[int], weights: Mapping[Tier, float]
                         ) -> dict[int, float]:
        """Per worker, the prefix blocks of ``overlap_by_tier`` each weighed by its tier:
        a device block is 1.0 unless ``weights`` says otherwise, a tier it leaves out is
        0 (Dynamo's ``KvRouterConfig`` defaults: host 0.75, disk 0.25).  A worker's best
        rank counts; workers without a hit are left out."""
        return self.prefix_hits(block_hashes, weights)[2]

    def prefix_hits(self, block_hashes: list[int], weights: Mapping[Tier, float]
                    ) -> tuple[dict[int, int], dict[int, dict[Tier, int]], dict[int, float]]:
        """``overlap``, ``overlap_by_tier`` and ``weighted_overlap`` from one walk of the
        ranks' prefixes (the router needs all three for every decision)."""
        w = {"device": 1.0, **weights}
        for tier, value in w.items():
            if tier not in _BIT or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"weights[{tier!r}]={value!r}: tiers are {TIERS}, weights "
                                 "finite and >= 0")
        per_tier = [w.get(tier, 0.0) for tier in TIERS]
        best: dict[int, list[int]] = {}
        weighted: dict[int, float] = {}
        device: dict[int, int] = {}
        for wid, counts, pool in self.tiers.rank_prefixes(block_hashes):
            if wid not in best or (sum(counts), counts) > (sum(best[wid]), best[wid]):
                best[wid] = counts
            score = sum(c * x for c, x in zip(counts, per_tier, strict=True))
            weighted[wid] = max(weighted.get(wid, 0.0), score)
            if pool:
                device[wid] = max(device.get(wid, 0), pool)
        return (device,
                {wid: dict(zip(TIERS, counts, strict=True)) for wid, counts in best.items()},
                weighted)

    def sync_workers(self, live: set[int]) -> None:
        """Drop the blocks of workers that left discovery."""
        for gone in self.known - live:
            self.tiers.remove_worker(gone)
            self._sequence.pop(gone, None)
        self.known = set(live)

    async def close(self) -> None:
        if self._nc is not None:
            await close_nats(self._nc, "KV-event")
