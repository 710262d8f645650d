"""Interrupt one task's await from a callback, and tell that interruption from any other.

A stream's reader awaits one item at a time; a deadline's timer or the caller's stop
must end that await at once, from a callback. ``asyncio.timeout`` does it by cancelling
the waiting task and taking the cancellation back when it reaches its ``async with``;
``Interruptible`` is that mechanism alone, without a context manager or a timer, so the
limits on every token's path (``MovingDeadline``, ``until_stopped`` in the worker
shells) can share it:

- ``await guard.wait(aw)`` is ``await aw`` while ``guard.interrupt()`` may cancel the
  task waiting; an interrupted wait raises ``Interrupted`` and leaves the task as it was
  (its cancel count taken back), whether the cancellation reached the await or the
  awaited code swallowed it and returned;
- a cancellation from elsewhere stays a ``CancelledError``, also when it comes together
  with an interrupt (then both are the caller's: the task is still being cancelled);
- outside a wait ``interrupt()`` does nothing and says so (the caller sees its own
  condition, a passed deadline or a done stop, before the next wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """The wait was ended by ``Interruptible.interrupt``."""


class Interruptible:
    """The await of one task at a time that a callback may end (see the module)."""

    __slots__ = ("_fired", "_loop", "_task", "_waiting")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._waiting = False
        self._fired = False

    @property
    def waiting(self) -> bool:
        return self._waiting

    async def wait(self, aw: Awaitable[T]) -> T:
        # The waiting task, each time: a stream's first item may be awaited by a
        # request's handler and the rest by the task that writes the response.  Asked of
        # the loop found at the first wait: without it, Python 3.11 finds the running
        # loop anew at every call, a getpid() system call each, twice per token where
        # two limits nest.
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task(loop)
        self._waiting = True
        try:
            value = await aw
        except asyncio.CancelledError:
            if self._fired and self._take_back():
                raise Interrupted from None
            raise
        finally:
            self._waiting = False
        if self._fired and self._take_back():  # the awaited code swallowed it
            raise Interrupted
        return value

    def interrupt(self, *_: Any) -> bool:
        """End the wait in progress (a done-callback's argument is ignored); False when
        there is none (or it is ending already)."""
        task = self._task
        if not self._waiting or self._fired or task is None or task.done():
            return False
        self._fired = True
        task.cancel()
        return True

    def _take_back(self) -> bool:
        """Undo the interrupt's cancellation; True when no other one is pending."""
        self._fired = False
        task = self._task
        return task is None or task.uncancel() == 0
