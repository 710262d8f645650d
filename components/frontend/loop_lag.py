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
"""

from __future__ import annotations

import asyncio
import math

INTERVAL_S = 0.02
WINDOW_S = 0.5


class LoopLag:
    """The event loop's recent lateness, in seconds (pure but for ``run``)."""

    def __init__(self) -> None:
        self.lag_s = 0.0
        self._at: float | None = None

    def observe(self, now: float, late_s: float) -> None:
        """A tick due ``late_s`` ago ran at ``now``."""
        if self._at is not None:
            self.lag_s *= math.exp(-(now - self._at) / WINDOW_S)
        self._at = now
        self.lag_s = max(self.lag_s, max(0.0, late_s))

    async def run(self, stopping: asyncio.Event, gauge=None) -> None:
        """Tick until ``stopping``; ``gauge`` (a Prometheus gauge) follows the lag."""
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            due = loop.time() + INTERVAL_S
            await asyncio.sleep(INTERVAL_S)
            now = loop.time()
            self.observe(now, now - due)
            if gauge is not None:
                gauge.set(self.lag_s)
