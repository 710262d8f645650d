"""Waiting on state that signals nothing.

An engine's in-flight count lives in another thread or process, a child's exit in the
kernel, a discovery list in Dynamo's runtime: none of them sets an asyncio event, so the
shells poll them. This is the one poll loop they share.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


async def poll_until(done: Callable[[], bool], timeout_s: float = math.inf,
                     poll_s: float = 0.05) -> bool:
    """Check ``done()`` every ``poll_s`` until it is true or ``timeout_s`` has passed.

    Called by drains (``inflight() == 0`` within the drain deadline) and waits on
    external state. Returns True when ``done()`` became true, False on timeout; checks
    once more at the deadline, so a zero timeout still reports the current state.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if done():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(poll_s, left))
