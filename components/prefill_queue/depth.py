"""Queue depth, and a background monitor that makes reading it free.

The decode worker's offload decider reads the prefill-queue depth for every request; a
server round trip there would add latency to every request, so the monitor refreshes the
depth in the background and answers synchronously with the last reading and its age.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueDepth:
    """Requests per priority level (index 0 = highest) at one moment.

    ``waiting``: not yet delivered to a prefill worker (consumer ``num_pending``);
    ``in_flight``: delivered and not yet acked (``num_ack_pending``); both count the shared
    queue and every worker's own.
    """

    waiting: tuple[int, ...]
    in_flight: tuple[int, ...]
    measured_at: float  # time.monotonic() when the answer arrived
    by_worker: Mapping[str, int] = field(default_factory=dict)
    """Jobs waiting or in flight in each prefill worker's own queue (prefix affinity),
    by worker id; included in ``waiting`` and ``in_flight``."""

    @property
    def per_level(self) -> tuple[int, ...]:
        """Waiting plus in flight, per level."""
        return tuple(w + f for w, f in zip(self.waiting, self.in_flight, strict=True))

    @property
    def total(self) -> int:
        """Depth across all levels: what the offload decider compares to its threshold."""
        return sum(self.waiting) + sum(self.in_flight)


class QueueDepthMonitor:
    """Refreshes the depth every ``refresh_s`` in a background task.

    Created by ``PrefillQueue.depth_monitor()`` (or directly with any ``fetch`` coroutine,
    which tests use); call ``start()`` once inside the event loop and ``stop()`` on
    shutdown.  A failed refresh keeps the previous reading, so ``age_s`` grows and the
    caller can treat an old reading as unknown.
    """

    def __init__(self, fetch: Callable[[], Awaitable[QueueDepth]], refresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._clock = clock
        self._last: QueueDepth | None = None
        self._task: asyncio.Task[None] | None = None
        self.errors = 0

    @property
    def last(self) -> QueueDepth | None:
        """The latest reading, or None before the first refresh succeeded."""
        return self._last

    @property
    def depth(self) -> int | None:
        """Latest total depth without I/O, or None when never measured."""
        return None if self._last is None else self._last.total

    @property
    def age_s(self) -> float | None:
        """Seconds since the latest reading was taken, or None when never measured."""
        return None if self._last is None else self._clock() - self._last.measured_at

    async def refresh(self) -> QueueDepth:
        """Measure now and remember the result; called by the loop, and by tests."""
        self._last = await self._fetch()
        return self._last

    async def start(self) -> None:
        """Take a first reading (errors propagate) and start refreshing in the background."""
        if self._task is not None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="prefill-queue-depth")

    async def stop(self) -> None:
        """Stop the background refresh; the last reading stays readable."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep refreshing through NATS hiccups
                self.errors += 1
                log.warning("prefill queue depth refresh failed: %s", exc)
