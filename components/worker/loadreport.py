"""Publishes a worker's load to routers over NATS a few times a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from splitserve.contracts.kit.connect import close_nats
from splitserve.contracts.kit.once import OncePerKind
from splitserve.contracts.wire import WorkerLoad

log = logging.getLogger("splitserve.worker")


class ReportFailures:
    """Counts failed load reports and logs the first of each kind of failure (a report
    every 0.2 s would otherwise flood the log while NATS is down)."""

    def __init__(self, counter=None) -> None:
        self.counter = counter  # a prometheus Counter, e.g. WorkerMetrics.load_report_failures
        self.logged = OncePerKind(log, "load report failed (counted; logged once per kind): %s")

    def __call__(self, exc: Exception) -> None:
        if self.counter is not None:
            self.counter.inc()
        self.logged(exc)


async def publish_load(nats_url: str, subject: str, sample: Callable[[], WorkerLoad],
                       interval_s: float, stopping: asyncio.Event,
                       failures: Callable[[Exception], None] | None = None) -> None:
    """Send ``sample()`` every ``interval_s`` until stopping; a last report says draining.

    A report that cannot be sampled or sent goes to ``failures`` (logged and counted by
    default) and the next one is tried on time."""
    from splitserve.contracts.kit.connect import connect_nats

    failed = failures or ReportFailures()
    nc = await connect_nats(nats_url, name="splitserve-worker-load",
                            max_reconnect_attempts=-1)
    try:
        while not stopping.is_set():
            try:
                await nc.publish(subject, sample().model_dump_json().encode())
            except Exception as exc:  # noqa: BLE001 - reported to ``failed``, retried
                failed(exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)
        try:
            final = sample().model_copy(update={"draining": True})
            await nc.publish(subject, final.model_dump_json().encode())
        except Exception as exc:  # noqa: BLE001 - routers then expire the worker instead
            failed(exc)
    finally:
        await close_nats(nc, "load-report")
