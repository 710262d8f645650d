"""MovingDeadline: asyncio.timeout's behaviour for each await, one timer per stream."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from splitserve.contracts.kit.deadline import MovingDeadline


def run(coro, loop_kind: str):
    if loop_kind == "uvloop":
        return uvloop.run(coro)
    return asyncio.run(coro)


LOOPS = ["asyncio", "uvloop"]


async def ticks(n: int, gap_s: float):
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield i


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_items_within_the_limit_pass_and_the_timer_is_shared(loop_kind):
    async def main():
        d = MovingDeadline()
        it = aiter(ticks(30, 0.002))
        out, handles = [], set()
        for _ in range(30):
            out.append(await d.within(anext(it), 0.5))
            handles.add(id(d._handle))
        d.close()
        return out, handles

    out, handles = run(main(), loop_kind)
    assert out == list(range(30))
    assert len(handles) == 1  # moved, never re-armed: every item came well within 0.5 s


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_late_item_raises_timeout_after_the_deadline_moved(loop_kind):
    async def slow_third():
        yield 1
        await asyncio.sleep(0.05)
        yield 2
        await asyncio.sleep(0.3)
        yield 3

    async def main():
        d = MovingDeadline()
        it = aiter(slow_third())
        loop = asyncio.get_running_loop()
        got = [await d.within(anext(it), 0.1), await d.within(anext(it), 0.1)]
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await d.within(anext(it), 0.1)
        waited = loop.time() - t0
        # the task was not left cancelled: it goes on awaiting normally
        await asyncio.sleep(0.01)
        return got, waited, asyncio.current_task().cancelling()

    got, waited, cancelling = run(main(), loop_kind)
    assert got == [1, 2]
    assert 0.09 <= waited < 0.25
    assert cancelling == 0


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_time_outside_within_does_not_count(loop_kind):
    async def main():
        d = MovingDeadline()
        it = aiter(ticks(3, 0.001))
        await d.within(anext(it), 0.05)
        await asyncio.sleep(0.15)  # the consumer busy elsewhere: the timer fires, ignored
        second = await d.within(anext(it), 0.05)
        d.close()
        return second

    assert run(main(), loop_kind) == 1


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_cancellation_from_elsewhere_stays_a_cancellation(loop_kind):
    async def main():
        d = MovingDeadline()

        async def waiter():
            return await d.within(asyncio.sleep(10), 5.0)

        t = asyncio.create_task(waiter())
        await asyncio.sleep(0.02)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        d.close()

    run(main(), loop_kind)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_nested_limits_each_raise_their_own_timeout(loop_kind):
    """The worker's stall limit inside the frontend's inter-token deadline: whichever
    expires first is the one that raises TimeoutError; the other passes it through."""

    async def inner_stream(inner: MovingDeadline, inner_s: float, gap_s: float):
        try:
            await inner.within(asyncio.sleep(gap_s), inner_s)
        except TimeoutError:
            yield "inner"
            return
        yield "item"

    async def main(inner_s: float, outer_s: float):
        inner, outer = MovingDeadline(), MovingDeadline()
        it = aiter(inner_stream(inner, inner_s, 0.3))
        try:
            return await outer.within(anext(it), outer_s)
        except TimeoutError:
            return "outer"
        finally:
            inner.close()
            outer.close()

    assert run(main(0.05, 1.0), loop_kind) == "inner"
    assert run(main(1.0, 0.05), loop_kind) == "outer"
