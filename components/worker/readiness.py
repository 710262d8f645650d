"""Report "ready" only once a worker's endpoint is really registered.

``serve_endpoint`` registers the instance in discovery some time after it is called;
reporting "ready" before that lets the supervisor (and `dynamo serve --ready-file`) call
the graph ready while no router or frontend can see the worker yet.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("splitserve.worker")


async def report_ready_when_registered(report, served, instance_id: int, /, *,
                                       timeout_s: float = 60.0, poll_s: float = 0.05,
                                       **fields: Any) -> bool:
    """Wait until discovery lists ``instance_id`` under the ``served`` endpoint, then
    ``report("ready", **fields)`` (``fields`` may include the report's own ``endpoint``).
    Run as a task beside the serving loop; returns False (reporting nothing) if the
    instance did not appear within ``timeout_s``."""
    client = await served.client()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while instance_id not in client.instance_ids():
        if loop.time() > deadline:
            log.warning("instance %x not in discovery after %.0fs; not reporting ready",
                        instance_id, timeout_s)
            return False
        await asyncio.sleep(poll_s)
    report("ready", **fields)
    return True
