"""Reading a worker's KV events and load metrics straight off NATS.

Dynamo 1.6.1's Python wheel exposes ``RadixTree`` but not ``KvIndexer``; a process that
wants its own prefix index (our router) subscribes to the worker endpoint's event
subjects and feeds its index (or a tree) itself.  Every message on these subjects is a msgpack
envelope ``{publisher_id, sequence, published_at, topic, payload}`` whose ``payload`` is
itself msgpack: a list of KV events for ``kv-events``, one dict for the metric topics.
See docs/mocker.md for the field lists.

Each KV event names its storage tier (``storage_tier``: ``device``, ``host_pinned``,
``disk``; absent means ``device``).  ``RadixTree`` itself has no tier: fed a lower tier's
events it would credit them as pool blocks, so only device-tier events reach it, and
every tier's go to a tier-aware sink (the router's ``KvEventIndex``, which keeps no tree).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgspec

from splitserve.contracts.block_events import BlockStored, KvEvent, Tier

KV_EVENTS = "kv-events"
KV_METRICS = "kv_metrics"
FORWARD_PASS_METRICS = "forward-pass-metrics"

WIRE_TIERS: Mapping[Tier, str] = {"device": "device", "host": "host_pinned", "disk": "disk"}
"""Dynamo's ``StorageTier`` name (a router event's ``storage_tier``) for each tier."""
_TIER_OF_WIRE = {wire: tier for tier, wire in WIRE_TIERS.items()}
_U64 = (1 << 64) - 1


def event_subject(namespace: str, component: str, topic: str,
                  endpoint: str = "generate") -> str:
    """NATS subject a worker endpoint publishes ``topic`` on."""
    return f"namespace.{namespace}.component.{component}.endpoint.{endpoint}.{topic}"


def decode_envelope(data: bytes) -> tuple[str, Any]:
    """Return (topic, decoded payload) of one event-plane message."""
    env = msgspec.msgpack.decode(data)
    return env["topic"], msgspec.msgpack.decode(env["payload"])


def event_tier(ev: Mapping[str, Any]) -> Tier | None:
    """The tier one decoded ``kv-events`` entry is about: ``device`` when it has no
    ``storage_tier`` (publishers from before tiers), None for a tier no index here keeps
    (Dynamo's ``external``: a cache shared by several workers)."""
    return _TIER_OF_WIRE.get(ev.get("storage_tier", "device"))


class TierSink(Protocol):
    """What follows every tier's events (the router's per-tier block index)."""

    def apply(self, worker_id: int, tier: Tier, event: Mapping[str, Any]) -> None:
        """Apply one inner event (``{event_id, data: {stored|removed|cleared: ...}}``)."""
        ...


def apply_kv_events(tree: Any, events: list[dict], tiers: TierSink | None = None) -> int:
    """Apply a decoded ``kv-events`` payload to a ``dynamo.llm.RadixTree`` (None: no
    tree), and to ``tiers`` when given.

    ``RadixTree.apply_event`` takes the JSON of the inner ``event`` object
    (``{event_id, data: {stored|removed|cleared: ...}}``) and the publishing worker's
    id; it gets the device tier's events only.  ``tiers`` gets every event of a known
    tier, before the tree (which raises on a store whose parent it lacks), so a bad
    device event cannot leave it behind.  Returns how many events were applied; those
    of an unknown tier are skipped.
    """
    known = [(ev, tier) for ev in events if (tier := event_tier(ev)) is not None]
    if tiers is not None:
        for ev, tier in known:
            tiers.apply(int(ev["worker_id"]), tier, ev["event"])
    if tree is None:
        return len(known)
    encode = msgspec.json.encode  # ~10x json.dumps on the long block lists of stored events
    for ev, tier in known:
        if tier == "device":
            tree.apply_event(int(ev["worker_id"]), encode(ev["event"]))
    return len(known)


class KvEventEncoder:
    """One worker's ``BlockStored`` / ``BlockRemoved`` as the router events Dynamo puts in
    a ``kv-events`` payload, with their tier.

    For a process that publishes tiered events itself (Dynamo 1.6.1's
    ``KvEventPublisher`` has no tier argument) and for tests that feed an index without
    NATS.  Blocks are keyed as Dynamo's publisher keys them: each block's own tokens
    hashed by ``compute_block_hash_for_seq`` (with the LoRA adapter's name), chained by
    the engine's hashes as unsigned 64-bit ints.
    """

    def __init__(self, worker_id: int, dp_rank: int = 0) -> None:
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.next_event_id = 0

    def encode(self, events: Iterable[KvEvent]) -> list[dict]:
        """The router events of ``events``, in order, numbered on from the last call."""
        out = []
        for ev in events:
            if isinstance(ev, BlockStored):
                data: dict[str, Any] = {"stored": {
                    "parent_hash": None if ev.parent_hash is None else ev.parent_hash & _U64,
                    "blocks": [{"block_hash": h & _U64, "tokens_hash": local}
                               for h, local in zip(ev.block_hashes, _tokens_hashes(ev),
                                                   strict=True)]}}
            else:
                data = {"removed": {"block_hashes": [h & _U64 for h in ev.block_hashes]}}
            out.append({"worker_id": self.worker_id, "storage_tier": WIRE_TIERS[ev.tier],
                        "event": {"event_id": self.next_event_id, "data": data,
                                  "dp_rank": self.dp_rank}})
            self.next_event_id += 1
        return out


def _tokens_hashes(ev: BlockStored) -> list[int]:
    """Dynamo's hash of each stored block's own tokens (what a router's lookup keys are)."""
    from dynamo.llm import compute_block_hash_for_seq

    sizes = set(ev.num_block_tokens)
    if len(sizes) == 1:  # full blocks: one call
        return compute_block_hash_for_seq(list(ev.token_ids), sizes.pop(),
                                          lora_name=ev.lora_name)
    out: list[int] = []
    start = 0
    for n in ev.num_block_tokens:
        out += compute_block_hash_for_seq(list(ev.token_ids[start:start + n]), n,
                                          lora_name=ev.lora_name)
        start += n
    return out
