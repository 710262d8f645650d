"""A time limit on each await of a stream, without a timer per await.

``asyncio.timeout`` around every chunk of a stream creates, schedules and cancels a timer
handle per chunk; a streamed answer pays that for every token, twice where two limits
nest (the worker's stall limit inside the frontend's inter-token deadline).
``MovingDeadline`` keeps one timer per limit period instead: each ``within`` call only
moves the deadline, and the timer, when it fires early, re-arms itself for the current
deadline.  Expiry behaves as ``asyncio.timeout``'s: the waiting task is cancelled and
the wait raises ``TimeoutError``; a cancellation from elsewhere stays a cancellation
(``Interruptible``, contracts/kit/interrupt.py, tells the two apart).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from splitserve.contracts.kit.interrupt import Interruptible, Interrupted

T = TypeVar("T")
# A timer may fire this much before its time (uvloop's clock counts milliseconds): that
# is the deadline, not a reason to re-arm for the rest.
_EARLY_S = 0.002


class MovingDeadline:
    """Time limits for the successive awaits of one stream's chunks (one wait at a time;
    an expiry interrupts the task waiting then: ``contracts/kit/interrupt.py``).

    ``await d.within(aw, timeout_s)`` is ``async with asyncio.timeout(timeout_s): await
    aw`` with the timer shared across calls.  Only the time spent inside ``within``
    counts: a timer that fires while the task does something else is dropped, and the
    next ``within`` arms a new one.  ``close`` drops the timer (call it when the stream
    ends; a forgotten one fires once and does nothing).  An await that the expiry
    interrupted raises ``TimeoutError`` even if the awaited code swallowed the
    cancellation and returned: the limit has passed.
    """

    __slots__ = ("_armed_at", "_deadline", "_guard", "_handle", "_loop")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._guard = Interruptible()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._deadline = math.inf

    async def within(self, aw: Awaitable[T], timeout_s: float) -> T:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._deadline = deadline = loop.time() + timeout_s
        if deadline < self._armed_at:
            self._arm(deadline)
        try:
            return await self._guard.wait(aw)
        except Interrupted:
            raise TimeoutError from None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed_at = math.inf

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        assert self._loop is not None
        self._handle = self._loop.call_at(when, self._fire)
        self._armed_at = when

    def _fire(self) -> None:
        self._handle, self._armed_at = None, math.inf
        if not self._guard.waiting:
            return  # the next ``within`` arms again
        assert self._loop is not None
        if self._deadline - self._loop.time() > _EARLY_S:
            self._arm(self._deadline)
            return
        self._guard.interrupt()
