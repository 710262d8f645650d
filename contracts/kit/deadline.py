"""A time limit on each await of a stream, without a timer per await.

``asyncio.timeout`` around every chunk of a stream creates, schedules and cancels a timer
handle per chunk; a streamed answer pays that for every token, twice where two limits
nest (the worker's stall limit inside the frontend's inter-token deadline).
``MovingDeadline`` keeps one timer per limit period instead: each ``within`` call only
moves the deadline, and the timer, when it fires early, re-arms itself for the current
deadline.  Expiry behaves as ``asyncio.timeout``'s: the waiting task is cancelled and
the wait raises ``TimeoutError``; a cancellation from elsewhere stays a cancellation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
# A timer may fire this much before its time (uvloop's clock counts milliseconds): that
# is the deadline, not a reason to re-arm for the rest.
_EARLY_S = 0.002


class MovingDeadline:
    """Time limits for the successive awaits of one stream's chunks (one wait at a time;
    an expiry cancels the task waiting then).

    ``await d.within(aw, timeout_s)`` is ``async with asyncio.timeout(timeout_s): await
    aw`` with the timer shared across calls.  Only the time spent inside ``within``
    counts: a timer that fires while the task does something else is dropped, and the
    next ``within`` arms a new one.  ``close`` drops the timer (call it when the stream
    ends; a forgotten one fires once and does nothing).
    """

    __slots__ = ("_armed_at", "_deadline", "_fired", "_handle", "_loop", "_task",
                 "_waiting")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._deadline = math.inf
        self._waiting = False
        self._fired = False

    async def within(self, aw: Awaitable[T], timeout_s: float) -> T:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        # The waiting task, each time: a stream's first chunk may be awaited by the
        # request's handler and the rest by the task that writes the response.
        self._task = asyncio.current_task()
        self._deadline = deadline = loop.time() + timeout_s
        if deadline < self._armed_at:
            self._arm(deadline)
        self._waiting = True
        try:
            return await aw
        except asyncio.CancelledError:
            if self._fired:
                self._fired = False
                task = self._task
                if task is not None and task.uncancel() == 0:
                    raise TimeoutError from None
            raise
        finally:
            self._waiting = False

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
        if not self._waiting or self._task is None or self._task.done():
            return  # the next ``within`` arms again
        assert self._loop is not None
        if self._deadline - self._loop.time() > _EARLY_S:
            self._arm(self._deadline)
            return
        self._fired = True
        self._task.cancel()
