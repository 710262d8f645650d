"""Stop serving a request as soon as its caller stops it.

Dynamo's runtime hands each endpoint handler the request's ``context``; the frontend
stops it (``stop_generating``) when its client leaves. A handler that only looks at the
context between tokens notices nothing while no token comes (a remote prefill in flight,
a long prompt being prefilled), and one that never looks depends on when the runtime
drops its generator. ``until_stopped`` races the stream against the context, so the
engine's request is aborted within one event-loop turn of the stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


def stop_signal(context, cut: asyncio.Event | None = None) -> asyncio.Future | None:
    """A future that completes when ``context`` is stopped or killed or ``cut`` is set,
    or None when there is neither (in-process calls, tests)."""
    waits = []
    if context is not None and hasattr(context, "async_killed_or_stopped"):
        waits.append(asyncio.ensure_future(context.async_killed_or_stopped()))
    if cut is not None:
        waits.append(asyncio.ensure_future(cut.wait()))
    if len(waits) <= 1:
        return waits[0] if waits else None
    first = asyncio.get_running_loop().create_future()

    def done(_: asyncio.Future) -> None:
        if not first.done():
            first.set_result(None)

    for w in waits:
        w.add_done_callback(done)
    first.add_done_callback(lambda _: [w.cancel() for w in waits])
    return first


class _Stop:
    """The stop's hold on the task reading the stream: the stop cancels that task only
    while it waits for an item (as ``asyncio.timeout`` does), and is seen between items
    otherwise."""

    __slots__ = ("fired", "task", "waiting")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.waiting = False
        self.fired = False

    def __call__(self, _: asyncio.Future) -> None:
        task = self.task
        if self.waiting and task is not None and not task.done():
            self.fired = True
            task.cancel()


async def until_stopped(stream: AsyncIterable[T], context,
                        cut: asyncio.Event | None = None) -> AsyncIterator[T]:
    """Yield ``stream``'s items until it ends, ``context`` is stopped or ``cut`` is set
    (the worker's drain deadline passed); then close it.

    Called by the worker shells around an engine's stream. Closing the stream is what
    aborts the request in the engine (every engine's stream aborts in its ``finally``).
    Returns quietly on a stop: the caller has gone and reads nothing more; after a cut
    the caller sends the ``drained`` chunk.

    The stop cancels the read it interrupts (the engine's stream sees the cancellation
    at its pending await, and its ``finally`` aborts the request); no task or wait is
    made per item (a task and ``asyncio.wait`` per token cost two more event-loop turns
    and about a dozen objects for every token a worker streams).
    """
    stopped = stop_signal(context, cut)
    it = aiter(stream)
    stop = _Stop()
    if stopped is not None:
        stopped.add_done_callback(stop)
    try:
        while stopped is None or not stopped.done():
            stop.task = asyncio.current_task()
            stop.waiting = True
            try:
                item = await anext(it)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if stop.fired and stop.task is not None and stop.task.uncancel() == 0:
                    return  # stopped: the caller has gone
                raise
            finally:
                stop.waiting = False
            if stop.fired:  # the stop came as the item did: the item is not wanted
                stop.fired = False
                if stop.task is not None:
                    stop.task.uncancel()
                return
            yield item
    finally:
        if stopped is not None:
            stopped.remove_done_callback(stop)
            stopped.cancel()
        for source in (it, stream) if it is not stream else (it,):
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
