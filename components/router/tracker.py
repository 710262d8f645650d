"""Remembers which worker recently received which prefix blocks.

The prefix index learns about a worker's cache only when the worker publishes its KV
events, a few milliseconds to seconds after the request landed.  Requests sharing a
prefix that arrive in that gap would all look uncached and be spread across workers.  The
router process records each decision here and reads ``recent_blocks`` into
``Snapshot.recent_prefix_blocks``, which the ``latency-cost`` scorer credits.

Pure: the caller passes ``now`` (seconds, monotonic, non-decreasing) to every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .types import WorkerId


class RecentPrefixTracker:
    """A TTL- and size-bounded map of (block hash, worker) -> time it was routed there."""

    def __init__(self, ttl_s: float = 5.0, capacity: int = 100_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._ttl = ttl_s
        self._capacity = capacity
        # Oldest first, so expiry and the capacity bound both evict from the front.
        self._entries: OrderedDict[tuple[int, WorkerId], float] = OrderedDict()
        self._by_hash: dict[int, dict[WorkerId, float]] = {}

    def __len__(self) -> int:
        """Number of (block, worker) pairs remembered."""
        return len(self._entries)

    def record(self, worker_id: WorkerId, block_hashes: Sequence[int], now: float) -> None:
        """Called after each routing decision: ``worker_id`` now holds these prefix blocks."""
        for block in block_hashes:
            key = (block, worker_id)
            if key in self._entries:
                self._entries.move_to_end(key)
            self._entries[key] = now
            self._by_hash.setdefault(block, {})[worker_id] = now
        self._evict(now)

    def recent_blocks(self, block_hashes: Sequence[int], now: float) -> dict[WorkerId, int]:
        """Called before routing: per worker, the length of the leading run of
        ``block_hashes`` recently routed to it (workers with none are left out).

        Only the leading run counts because a prefix cache can only reuse a prompt's
        blocks from the start up to the first block it lacks.
        """
        self._evict(now)
        counts: dict[WorkerId, int] = {}
        alive: set[WorkerId] | None = None
        for block in block_hashes:
            holders = set(self._by_hash.get(block, ()))
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for worker in alive:
                counts[worker] = counts.get(worker, 0) + 1
        return counts

    def _evict(self, now: float) -> None:
        horizon = now - self._ttl
        while self._entries:
            (block, worker), seen = next(iter(self._entries.items()))
            if len(self._entries) <= self._capacity and seen > horizon:
                break
            del self._entries[(block, worker)]
            holders = self._by_hash[block]
            del holders[worker]
            if not holders:
                del self._by_hash[block]
