"""The router's admission queue: admitted requests wait here for a slot, by least slack.

Adapter around the pure ``SlackQueue`` (``components/router/qos/slack_queue.py``): each waiting
route call holds a future; a release (or a waiter's own deadline) moves the queue.  The
fleet view comes in as two numbers (requests placed, workers routable), so the same queue
serves the router process and an in-process router in the frontend.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from splitserve.components.router.qos.slack_queue import QueueConfig, SlackQueue

Outcome = Literal["go", "doomed", "full"]


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())


class AdmissionQueue:
    """Holds admitted requests while every worker is at ``max_inflight_per_worker``."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config
        self.queue: SlackQueue[_Waiter] = SlackQueue(config.max_queued)
        self.reserved = 0  # slots handed to waiters that have not placed yet

    @property
    def enabled(self) -> bool:
        """False when ``max_inflight_per_worker`` is 0: requests go straight through."""
        return self.config.max_inflight_per_worker > 0

    def reconfigure(self, config: QueueConfig) -> None:
        """A new policy version; waiting requests stay queued."""
        self.config = config
        self.queue.capacity = config.max_queued

    def free_slots(self, placed: int, workers: int) -> int:
        """Slots left under the cap, net of those already handed to waiters."""
        return self.config.max_inflight_per_worker * max(1, workers) - placed - self.reserved

    async def wait(self, deadline: float, sheddable: bool, now: float, placed: int,
                   workers: int) -> Outcome:
        """Called before placing an admitted request: 'go' once it may be placed (then
        ``placed_one`` must follow), 'doomed' when it is shed, 'full' when the queue is."""
        if not self.enabled or (len(self.queue) == 0 and self.free_slots(placed, workers) > 0):
            self.reserved += 1 if self.enabled else 0
            return "go"
        waiter = _Waiter()
        if not self.queue.push(waiter, deadline, sheddable):
            return "full"
        limit = self.config.max_wait_s
        if sheddable:
            limit = min(limit, max(0.0, deadline - now))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), limit)
        except asyncio.CancelledError:
            # The caller gave up (its route call timed out): leave no waiter and no slot.
            if not self.queue.remove(waiter) and waiter.future.done() \
                    and waiter.future.result() == "go":
                self.placed_one()
            raise
        except TimeoutError:
            if self.queue.remove(waiter):
                if sheddable:
                    return "doomed"
                self.reserved += 1  # waited long enough: placed over the cap
                return "go"
            return await waiter.future  # handed a verdict just as the wait ended

    def placed_one(self) -> None:
        """Called once a request that got 'go' has been placed (or failed to be)."""
        if self.enabled and self.reserved > 0:
            self.reserved -= 1

    def dispatch(self, now: float, placed: int, workers: int) -> None:
        """Called after every release: hand free slots to the least-slack waiters and
        shed the doomed ones met on the way."""
        while len(self.queue) and self.free_slots(placed, workers) > 0:
            waiter, doomed = self.queue.pop(now)
            for d in doomed:
                if not d.future.done():
                    d.future.set_result("doomed")
            if waiter is None:
                return
            if not waiter.future.done():
                self.reserved += 1
                waiter.future.set_result("go")
