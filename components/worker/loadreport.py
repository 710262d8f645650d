"""Publishes a worker's load to routers over NATS a few times a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from splitserve.components.protocol import WorkerLoad

log = logging.getLogger("splitserve.worker")


async def publish_load(nats_url: str, subject: str, sample: Callable[[], WorkerLoad],
                       interval_s: float, stopping: asyncio.Event) -> None:
    """Send ``sample()`` every ``interval_s`` until stopping; a last report says draining."""
    from splitserve.common.connect import connect_nats

    nc = await connect_nats(nats_url, name="splitserve-worker-load",
                            max_reconnect_attempts=-1)
    try:
        while not stopping.is_set():
            with contextlib.suppress(Exception):
                await nc.publish(subject, sample().model_dump_json().encode())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)
        final = sample().model_copy(update={"draining": True})
        with contextlib.suppress(Exception):
            await nc.publish(subject, final.model_dump_json().encode())
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
