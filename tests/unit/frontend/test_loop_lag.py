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


class Counting(LoopLag):
    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def observe(self, now: float, late_s: float) -> None:
        self.ticks += 1
        super().observe(now, late_s)


def test_idle_it_ticks_slowly_and_a_request_brings_the_fast_tick_back():
    """With nothing in flight the monitor does not wake 50 times a second; an arrival
    (``wake``) brings the 20 ms tick back at once, and a blocked loop is seen then."""

    async def go():
        lag, stop, busy = Counting(), asyncio.Event(), [False]
        task = asyncio.create_task(lag.run(stop, busy=lambda: busy[0]))
        await asyncio.sleep(0.3)
        idle_ticks = lag.ticks
        busy[0] = True
        lag.wake()
        await asyncio.sleep(0.2)
        busy_ticks = lag.ticks - idle_ticks
        hold_the_loop(0.3)
        await asyncio.sleep(0.05)
        seen = lag.lag_s
        busy[0] = False
        await asyncio.sleep(0.1)  # the tick under way ends; the idle wait begins
        stop.set()
        lag.wake()
        await asyncio.wait_for(task, 1.0)  # a stop is seen at the wake
        return idle_ticks, busy_ticks, seen

    idle_ticks, busy_ticks, seen = asyncio.run(go())
    assert idle_ticks == 0
    assert busy_ticks >= 4
    assert seen > 0.2
