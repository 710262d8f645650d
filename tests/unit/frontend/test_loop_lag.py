"""The event loop's lag: measured by a late tick, fading, and a frontend that refuses new
requests while it is far behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.components.frontend.loop_lag import WINDOW_S, LoopLag

pytestmark = pytest.mark.unit


def test_the_lag_is_the_largest_recent_lateness_and_fades():
    lag = LoopLag()
    lag.observe(0.0, 0.001)
    lag.observe(0.02, 0.4)
    lag.observe(0.04, 0.002)
    assert lag.lag_s == pytest.approx(0.4 * pow(2.718281828, -0.02 / WINDOW_S), rel=1e-3)
    lag.observe(0.04 + 5 * WINDOW_S, 0.0)
    assert lag.lag_s < 0.01


def hold_the_loop(seconds: float) -> None:
    """A callback that keeps the event loop from running anything else."""
    time.sleep(seconds)


def test_a_blocked_loop_is_seen():
    async def go():
        lag = LoopLag()
        stop = asyncio.Event()
        task = asyncio.create_task(lag.run(stop))
        await asyncio.sleep(0.05)
        hold_the_loop(0.3)
        await asyncio.sleep(0.05)
        stop.set()
        await task
        return lag.lag_s
    assert asyncio.run(go()) > 0.2
