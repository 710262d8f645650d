"""A bounded queue of admitted requests served by least slack, shedding the doomed.

When every worker is at its in-flight cap (``QueueConfig.max_inflight_per_worker``), an
admitted request waits in the router instead of in an engine's own queue, where nothing
could reorder or drop it.  The next free slot goes to the waiting request with the least
slack: the earliest ``deadline`` (arrival + its class's TTFT target), so a ``high``
request overtakes the ``default`` ones that arrived shortly before it, and within a class
the order is first come, first served.  A request of a rejectable class whose deadline
passed while it waited is doomed: it is shed (answered 503) before it takes engine time.

Pure: the caller passes ``now``; items are opaque.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pydantic import Field

from splitserve.contracts.models import StrictModel

T = TypeVar("T")


class QueueConfig(StrictModel):
    """The ``qos.queue`` section: the router's admission queue (off by default)."""

    max_inflight_per_worker: int = Field(
        default=0, ge=0, description="Requests the router lets run on each worker at once; "
        "more wait in the router, served by least slack. 0 turns the queue off.")
    max_queued: int = Field(default=1024, ge=1,
                            description="Requests waiting at most; more are rejected "
                            "('queue-full').")
    max_wait_s: float = Field(
        default=4.0, gt=0, le=30, description="Longest wait in the queue: then a rejectable "
        "request is shed ('deadline-passed') and any other is placed over the cap. Keep it "
        "below the frontend's route timeout.")


@dataclass(order=True)
class _Entry(Generic[T]):
    deadline: float
    seq: int
    item: T = field(compare=False)
    sheddable: bool = field(compare=False)


class SlackQueue(Generic[T]):
    """Waiting requests by deadline; ``pop`` is called whenever a slot frees."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._heap: list[_Entry[T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T, deadline: float, sheddable: bool) -> bool:
        """Queue ``item``; returns False (nothing queued) when the queue is full."""
        if len(self._heap) >= self.capacity:
            return False
        heapq.heappush(self._heap, _Entry(deadline, next(self._seq), item, sheddable))
        return True

    def remove(self, item: T) -> bool:
        """Drop ``item`` (its caller gave up); returns True if it was waiting."""
        for i, entry in enumerate(self._heap):
            if entry.item is item:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def pop(self, now: float) -> tuple[T | None, list[T]]:
        """Return the next request to place (None if none) and the doomed ones shed on
        the way: sheddable requests whose deadline is already past."""
        doomed: list[T] = []
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.sheddable and entry.deadline < now:
                doomed.append(entry.item)
                continue
            return entry.item, doomed
        return None, doomed
