"""How far behind the frontend's event loop runs, and the refusal it justifies.

Every request's parsing, placement and every streamed chunk take turns on one event
loop.  When requests arrive faster than the loop can serve them (a burst of short
prompts: each costs a few CPU-milliseconds here), every callback waits its turn, and
the wait lands on first tokens and chunks that admission never predicted: admitting
more only makes every stream later.  A callback due every ``INTERVAL_S`` measures how
late it runs; the lag is the largest recent lateness, fading over ``WINDOW_S``
(``splitserve_frontend_event_loop_lag_seconds``).  While it exceeds
``Frontend.max_loop_lag_ms`` (off by default) new requests are refused at once with 503
``overloaded`` (before parsing), so the requests already admitted keep the loop.

With no request in flight the tick comes every ``IDLE_INTERVAL_S`` instead (an idle
frontend woke 50 times a second for it), and a request's arrival (``wake``) brings the
fast tick back at once, so a burst is measured from its first request.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

INTERVAL_S = 0.02
WINDOW_S = 0.5
IDLE_INTERVAL_S = 1.0


class LoopLag:
    """The event loop's recent lateness, in seconds (pure but for ``run``)."""

    def __init__(self) -> None:
        self.lag_s = 0.0
        self._at: float | None = None
        self._wake: asyncio.Event | None = None

    def wake(self) -> None:
        """A request arrived: tick every ``INTERVAL_S`` again, from now."""
        if self._wake is not None:
            self._wake.set()

    def observe(self, now: float, late_s: float) -> None:
        """A tick due ``late_s`` ago ran at ``now``."""
        if self._at is not None:
            self.lag_s *= math.exp(-(now - self._at) / WINDOW_S)
        self._at = now
        self.lag_s = max(self.lag_s, max(0.0, late_s))

    async def run(self, stopping: asyncio.Event, gauge=None,
                  busy: Callable[[], bool] | None = None) -> None:
        """Tick until ``stopping``; ``gauge`` (a Prometheus gauge) follows the lag;
        ``busy``: whether requests are in flight (None: always), else the tick slows to
        ``IDLE_INTERVAL_S`` until ``wake``.  ``stopping`` is seen at the next tick or
        wake."""
        loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        while not stopping.is_set():
            if busy is not None and not busy():
                wake.clear()
                due = loop.time() + IDLE_INTERVAL_S
                try:
                    async with asyncio.timeout(IDLE_INTERVAL_S):
                        await wake.wait()
                    continue  # a request came: the fast tick measures from now
                except TimeoutError:
                    pass
            else:
                due = loop.time() + INTERVAL_S
                await asyncio.sleep(INTERVAL_S)
            now = loop.time()
            self.observe(now, now - due)
            if gauge is not None:
                gauge.set(self.lag_s)
