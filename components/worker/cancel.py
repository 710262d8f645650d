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
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


def stop_signal(context) -> asyncio.Future | None:
    """A future that completes when ``context`` is stopped or killed, or None when the
    caller gave no context (in-process calls, tests)."""
    if context is None or not hasattr(context, "async_killed_or_stopped"):
        return None
    return asyncio.ensure_future(context.async_killed_or_stopped())


async def until_stopped(stream: AsyncIterable[T], context) -> AsyncIterator[T]:
    """Yield ``stream``'s items until it ends or ``context`` is stopped; then close it.

    Called by the worker shells around an engine's stream. Closing the stream is what
    aborts the request in the engine (every engine's stream aborts in its ``finally``).
    Returns quietly on a stop: the caller has gone and reads nothing more.
    """
    stopped = stop_signal(context)
    it = aiter(stream)
    nxt: asyncio.Future | None = None
    try:
        while True:
            if stopped is None:
                read = anext(it)  # no context to race: no task per item either
            else:
                read = nxt = asyncio.ensure_future(anext(it))
                await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    return  # stopped: the finally below cancels the pending read
            try:
                item = await read
            except StopAsyncIteration:
                return
            yield item
    finally:
        if stopped is not None:
            stopped.cancel()
        if nxt is not None and not nxt.done():
            # Cancelling the pending read raises inside the engine's stream, whose own
            # ``finally`` aborts the request; then it is closed and aclose() is a no-op.
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
        for source in (it, stream) if it is not stream else (it,):
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
