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

from splitserve.contracts.kit.interrupt import Interruptible, Interrupted

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
    and about a dozen objects for every token a worker streams): the read is an
    ``Interruptible`` wait (contracts/kit/interrupt.py), which the stop interrupts.
    """
    stopped = stop_signal(context, cut)
    it = aiter(stream)
    guard = Interruptible()
    if stopped is not None:
        stopped.add_done_callback(guard.interrupt)
    try:
        while stopped is None or not stopped.done():
            try:
                item = await guard.wait(anext(it))
            except (StopAsyncIteration, Interrupted):
                return  # the stream ended, or the caller stopped it (and has gone)
            yield item
    finally:
        if stopped is not None:
            stopped.remove_done_callback(guard.interrupt)
            stopped.cancel()
        for source in (it, stream) if it is not stream else (it,):
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
