"""Requests held in the router instead of refused (``qos.hold``; the rules are in
``components/router/qos/hold.py``).

Each held request is a future its ``place`` call awaits.  Entries are served by
deadline (arrival + its class's TTFT target, so within a class first come, first
served); only the head is judged again (``RouterService`` passes a ``judge`` callback),
since what holds it, the batch its workers would form, holds the ones behind it too.
A new request is judged once when it arrives, so one that must be refused is refused at
once rather than after waiting its turn.

Pure of I/O: the caller passes ``now`` and wakes ``pump`` (on first tokens, TPOT
reports, releases, and every ``tick_s`` while something is held).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What ``judge`` returns for the head: "held" keeps it, anything else is its reply.
HELD = "held"


@dataclass(order=True)
class HeldEntry:
    deadline: float  # arrival + its class's TTFT target: the serving order
    seq: int
    call: Any = field(compare=False)
    arrival: float = field(compare=False)
    expires: float = field(compare=False)  # when the hold ends (placed or refused)
    reason: str = field(compare=False)  # the verdict reason it was first held for
    future: asyncio.Future = field(compare=False)
    hashes: Any = field(default=None, compare=False)
    """The prompt's block hashes, computed once for all its judgments."""
    judged_at: float = field(default=float("-inf"), compare=False)
    judged_after: int = field(default=-1, compare=False)
    """When it was last judged, and the count of changes (``RouterService``'s) it saw:
    judged again before a tick only once something it waits for has changed."""


class HoldQueue:
    """A bounded, deadline-ordered set of held requests."""

    def __init__(self) -> None:
        self._heap: list[HeldEntry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, call: Any, arrival: float, deadline: float, expires: float,
             reason: str, hashes: Any = None, judged_after: int = -1) -> HeldEntry:
        """Hold ``call``; ``judged_after``: the change count its judgment at ``arrival``
        saw (it was judged as it arrived)."""
        entry = HeldEntry(deadline, next(self._seq), call, arrival, expires, reason,
                          asyncio.get_running_loop().create_future(), hashes,
                          judged_at=arrival, judged_after=judged_after)
        heapq.heappush(self._heap, entry)
        return entry

    def pump(self, now: float,
             judge: Callable[[HeldEntry, float, bool], Any],
             ended: Callable[[HeldEntry, str, float], None]) -> int:
        """Judge the head until one stays held: ``judge(entry, now, final)`` returns
        ``HELD`` or the entry's reply (``final``: its hold has expired, so it must be
        answered now).  ``ended(entry, outcome, now)`` is told of every entry that
        leaves, with 'answered', 'cancelled' or 'failed' (``judge`` raised: the
        caller's await raises it, the others are judged on).  Returns how many left."""
        left = 0
        while self._heap:
            head = self._heap[0]
            if head.future.done():  # its caller gave up (client gone, route timeout)
                heapq.heappop(self._heap)
                ended(head, "cancelled", now)
                left += 1
                continue
            try:
                reply = judge(head, now, now >= head.expires)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the queue
                heapq.heappop(self._heap)
                head.future.set_exception(exc)
                ended(head, "failed", now)
                left += 1
                continue
            if reply == HELD:
                return left
            heapq.heappop(self._heap)
            head.future.set_result(reply)
            ended(head, "answered", now)
            left += 1
        return left

    def next_due(self, tick_s: float) -> float | None:
        """When the head must be judged next on time alone: ``tick_s`` after its last
        judgement, or when its hold ends if sooner (None when empty)."""
        if not self._heap:
            return None
        head = self._heap[0]
        return min(head.judged_at + tick_s, head.expires)

    def next_expiry(self) -> float | None:
        """When the head's hold ends (None when empty)."""
        return self._heap[0].expires if self._heap else None
