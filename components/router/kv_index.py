"""The router's prefix index: Dynamo's RadixTree fed by workers' KV events from NATS.

Dynamo 1.6.1's wheel exposes ``RadixTree`` but not ``KvIndexer``, so the router
subscribes to the workers' ``kv-events`` subject on the event plane itself and applies
each event to its own tree.  Workers that leave discovery are removed from the tree.
"""

from __future__ import annotations

import logging

from splitserve.contracts.kit.connect import close_nats
from splitserve.contracts.kv_events import KV_EVENTS, apply_kv_events, decode_envelope, event_subject

log = logging.getLogger("splitserve.router")


class KvEventIndex:
    """Prefix overlap per worker, kept current from KV events."""

    def __init__(self, namespace: str, component: str) -> None:
        from dynamo.llm import RadixTree

        self.tree = RadixTree()
        self.subject = event_subject(namespace, component.lower(), KV_EVENTS)
        self.known: set[int] = set()
        self.applied = 0
        self.errors = 0
        self._nc = None

    async def start(self, nats_url: str) -> None:
        """Subscribe to the workers' KV events (call once at startup)."""
        from splitserve.contracts.kit.connect import connect_nats

        self._nc = await connect_nats(nats_url, name="splitserve-router-kv",
                                      max_reconnect_attempts=-1)
        await self._nc.subscribe(self.subject, cb=self._on_msg)

    async def _on_msg(self, msg) -> None:
        try:
            topic, payload = decode_envelope(msg.data)
            if topic == KV_EVENTS:
                self.applied += apply_kv_events(self.tree, payload)
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the index
            self.errors += 1
            log.warning("could not apply KV event: %s", exc)

    def overlap(self, block_hashes: list[int]) -> dict[int, int]:
        """Cached prefix blocks per worker for the request's local block hashes.

        The tree scores (worker_id, dp_rank) pairs; a worker's overlap is its best rank.
        """
        out: dict[int, int] = {}
        for key, blocks in self.tree.find_matches(block_hashes).scores.items():
            wid = key[0] if isinstance(key, tuple) else key
            out[int(wid)] = max(out.get(int(wid), 0), int(blocks))
        return out

    def sync_workers(self, live: set[int]) -> None:
        """Drop the blocks of workers that left discovery."""
        for gone in self.known - live:
            self.tree.remove_worker(gone)
        self.known = set(live)

    async def close(self) -> None:
        if self._nc is not None:
            await close_nats(self._nc, "KV-event")
