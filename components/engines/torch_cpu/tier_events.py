"""Publishing the torch engine's lower KV tiers' events to the routers.

Dynamo 1.6.1's ``KvEventPublisher`` has no tier argument: whatever it publishes reads
as the pool's.  So a worker sends its pool's events through it, as before, and the
``host`` and ``disk`` tiers' events here, on a subject of this project's own
(``tier_event_subject``), as envelopes of Dynamo's shape that every router's
``KvEventIndex`` reads.  Each envelope carries a sequence number that counts up by one
per message, so a router that misses one sees the gap, and the tiers' capacity in
blocks.

``TierEnvelopes`` is the pure part (events in, bytes out); ``TierEventPublisher`` hands
its bytes to NATS from the worker's event loop, in order, counting what it sent and
what failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping

import msgspec

from splitserve.contracts.block_events import LOWER_TIERS, TIER_EVENTS_TOPIC, KvEvent, Tier
from splitserve.contracts.kv_events import KvEventEncoder

log = logging.getLogger("splitserve.worker")


class TierEnvelopes:
    """One worker's lower-tier events as numbered envelopes; pure, no I/O."""

    def __init__(self, worker_id: int, capacity: Mapping[Tier, int]) -> None:
        self.worker_id = worker_id
        self.capacity = dict(capacity)
        self.encoder = KvEventEncoder(worker_id)
        self.sequence = 0  # of the next envelope

    def envelope(self, events: Iterable[KvEvent]) -> bytes | None:
        """The envelope of ``events``' lower-tier ones (the pool's go through Dynamo's
        publisher), or None when there are none."""
        lower = [ev for ev in events if ev.tier in LOWER_TIERS]
        if not lower:
            return None
        payload = msgspec.msgpack.encode(self.encoder.encode(lower))
        data = msgspec.msgpack.encode({
            "publisher_id": self.worker_id, "sequence": self.sequence,
            "published_at": int(time.time() * 1000), "topic": TIER_EVENTS_TOPIC,
            "payload": payload, "capacity": self.capacity})
        self.sequence += 1
        return data


class TierEventPublisher:
    """Sends ``TierEnvelopes`` on ``subject`` from the event loop, in order."""

    def __init__(self, envelopes: TierEnvelopes, subject: str) -> None:
        self.envelopes = envelopes
        self.subject = subject
        self.published = 0
        self.failures = 0
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()

    def submit(self, events: list[KvEvent]) -> None:
        """Queue the lower-tier events of ``events`` (called on the event loop, with every
        batch the engine drains, after the pool's went to Dynamo's publisher)."""
        data = self.envelopes.envelope(events)
        if data is not None:
            self._queue.put_nowait(data)

    async def run(self, nc) -> None:
        """Publish queued envelopes on ``nc`` until cancelled.  A failed publish is counted
        and logged; its sequence number is spent, so routers see the gap."""
        while True:
            data = await self._queue.get()
            try:
                await nc.publish(self.subject, data)
                self.published += 1
            except Exception as exc:  # noqa: BLE001 - routers see the gap; keep publishing
                self.failures += 1
                log.warning("could not publish KV tier events: %s", exc)
