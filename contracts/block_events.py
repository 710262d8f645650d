"""KV cache events every engine's relay produces, and the chained block hash.

Events are plain data: an engine (or its relay: vLLM, SGLang, TensorRT-LLM) produces
them and the worker process publishes them (Dynamo's ``KvEventPublisher.publish_stored`` /
``publish_removed`` take these fields, all but the tier), so the router's prefix index
mirrors which blocks this engine holds.

Each event names the storage tier it is about: the engine's KV pool (``device``) or an
offload tier below it (``host`` memory, ``disk``).  A block that moves between tiers is
removed from one and stored in the other, so the index knows where a worker could read a
prefix back from instead of recomputing it.  Dynamo carries the tier as the
``storage_tier`` of each event on the wire (``kv_events.py``), but its 1.6.1 Python
publisher has no argument for it: whatever it publishes is the device tier.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "host", "disk"]
"""Where a worker holds a block: its KV pool, host memory below it, or disk."""

TIERS: tuple[Tier, ...] = ("device", "host", "disk")
"""Every tier, fastest first: a block held in two tiers is served from the first."""


@dataclass(frozen=True)
class BlockStored:
    """Full blocks that became hashed and reusable, in sequence order.

    ``token_ids`` is the concatenation of every stored block's tokens and
    ``num_block_tokens[i]`` is how many of them belong to ``block_hashes[i]``.
    ``parent_hash`` is the hash of the block before the first one (None at the
    start of a sequence).
    """

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    num_block_tokens: tuple[int, ...]
    lora_name: str | None = None
    """The LoRA adapter whose KV these blocks hold (None: the base model); the router's
    hashes of them are keyed by it, so a prefix is never credited across adapters."""
    tier: Tier = "device"
    """The tier that now holds these blocks (events from before tiers mean the pool)."""


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left a tier; their hashes are no longer served from it."""

    block_hashes: tuple[int, ...]
    tier: Tier = "device"
    """The tier the blocks left (events from before tiers mean the pool)."""


KvEvent = BlockStored | BlockRemoved

LOWER_TIERS: tuple[Tier, ...] = ("host", "disk")
"""The tiers below the pool, whose events travel on ``tier_event_subject``."""

TIER_EVENTS_TOPIC = "kv-tier-events"
"""The ``topic`` of a tier-event envelope."""


def tier_event_subject(namespace: str, component: str) -> str:
    """NATS subject on which the workers of ``component`` publish their lower tiers'
    KV events (``host``, ``disk``), beside Dynamo's own ``kv-events`` subject.

    Dynamo 1.6.1's ``KvEventPublisher`` has no tier argument, so a worker publishes its
    pool's events through it and its lower tiers' here, as envelopes of Dynamo's shape
    (``{publisher_id, sequence, published_at, topic, payload}``, msgpack; ``payload`` a
    msgpack list of router events with their ``storage_tier``) plus ``capacity``: the
    blocks each lower tier can hold.  ``sequence`` counts up by one per message of each
    publisher, so a router sees a lost message as a gap.  A subject of this project's
    own, not Dynamo's: Dynamo's indexers on ``kv-events`` expect one publisher per
    worker and would take a second stream for the pool's.
    """
    return f"splitserve.{namespace}.{component.lower()}.kv-tier-events"


def kv_announce_subject(namespace: str, component: str) -> str:
    """NATS subject on which a router asks the workers of ``component`` to announce
    their whole KV cache again (JSON ``{"worker_id": ID}``, or ``null`` for every
    worker): a router that starts after the workers, or that lost a worker's tier
    events, would otherwise see only what changes from then on.  The workers answer on
    their usual event streams, in order with their other events."""
    return f"splitserve.{namespace}.{component.lower()}.kv-announce"


def hash_block(parent_hash: int | None, token_ids: Sequence[int],
               lora_name: str | None = None) -> int:
    """Return the signed 64-bit hash of one full block.

    Called for every block as it fills. Chaining the parent's hash makes a
    block's hash identify the whole prefix up to and including it, so equal
    hashes mean equal KV contents. blake2b rather than ``hash()`` because the
    value must be the same in every process (prefill and decode workers, router).
    ``lora_name``: the adapter the KV was computed with; it seeds a sequence's first
    block (later blocks inherit it through the chain), so the same tokens under two
    adapters, or under an adapter and the base model, never share a hash.
    """
    h = hashlib.blake2b(digest_size=8)
    if parent_hash is None and lora_name is not None:
        h.update(b"lora\0" + lora_name.encode())
    h.update(struct.pack("<q", 0 if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little", signed=True)
