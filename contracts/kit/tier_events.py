"""Publishing an engine's lower KV tiers' events to the routers (every engine's: the
torch engine's own tiers, and vLLM's, SGLang's and TensorRT-LLM's through their relays).

Dynamo 1.6.1's ``KvEventPublisher`` has no tier argument: whatever it publishes reads
as the pool's.  So a worker sends its pool's events through it, as before, and the
``host`` and ``disk`` tiers' events here, on a subject of this project's own
(``tier_event_subject``), as envelopes of Dynamo's shape that every router's
``KvEventIndex`` reads.  Each envelope carries a sequence number that counts up by one
per message, so a router that misses one sees the gap, the tiers' capacity in blocks,
and what restoring one block from each tier measurably takes (``restore_ms_per_block``,
which the routers' admission prices a lower-tier prefix hit at; only engines that
measure it send it, the others' hits are priced by the tier weights).  A tier whose
capacity the engine does not tell is left out of ``capacity``.  A change of that cost
by more than ``RESTORE_COST_CHANGE`` is sent even without events.

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

RESTORE_COST_CHANGE = 0.1
"""Relative change of a tier's restore cost that is worth an envelope of its own."""


class TierEnvelopes:
    """One worker's lower-tier events as numbered envelopes; pure, no I/O."""

    def __init__(self, worker_id: int, capacity: Mapping[Tier, int | None]) -> None:
        self.worker_id = worker_id
        self.capacity = {t: int(n) for t, n in capacity.items() if n is not None}
        self.encoder = KvEventEncoder(worker_id)
        self.sequence = 0  # of the next envelope
        self.sent_costs: dict[Tier, float] = {}  # restore costs in the last envelope

    def envelope(self, events: Iterable[KvEvent],
                 restore_ms: Mapping[Tier, float] | None = None) -> bytes | None:
        """The envelope of ``events``' lower-tier ones (the pool's go through Dynamo's
        publisher) with the tiers' measured restore costs ``restore_ms`` (ms per block);
        None when there are no such events and no cost changed by more than
        ``RESTORE_COST_CHANGE``."""
        lower = [ev for ev in events if ev.tier in LOWER_TIERS]
        costs = {t: float(ms) for t, ms in (restore_ms or {}).items() if t in LOWER_TIERS}
        if not lower and not self._costs_moved(costs):
            return None
        payload = msgspec.msgpack.encode(self.encoder.encode(lower))
        data = msgspec.msgpack.encode({
            "publisher_id": self.worker_id, "sequence": self.sequence,
            "published_at": int(time.time() * 1000), "topic": TIER_EVENTS_TOPIC,
            "payload": payload, "capacity": self.capacity, "restore_ms_per_block": costs})
        self.sequence += 1
        self.sent_costs = costs
        return data

    def _costs_moved(self, costs: Mapping[Tier, float]) -> bool:
        for tier, ms in costs.items():
            sent = self.sent_costs.get(tier)
            if sent is None or abs(ms - sent) > RESTORE_COST_CHANGE * max(sent, 1e-3):
                return True
        return False


class TierEventPublisher:
    """Sends ``TierEnvelopes`` on ``subject`` from the event loop, in order."""

    def __init__(self, envelopes: TierEnvelopes, subject: str) -> None:
        self.envelopes = envelopes
        self.subject = subject
        self.published = 0
        self.failures = 0
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()

    def submit(self, events: list[KvEvent],
               restore_ms: Mapping[Tier, float] | None = None) -> None:
        """Queue the lower-tier events of ``events`` and the tiers' restore costs (called
        on the event loop, with every batch the engine drains, after the pool's went to
        Dynamo's publisher)."""
        data = self.envelopes.envelope(events, restore_ms)
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
