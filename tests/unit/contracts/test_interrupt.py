"""Interruptible: one task's await ended from a callback, told apart from any other
cancellation, the task left as it was."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from splitserve.contracts.kit.deadline import MovingDeadline
from splitserve.contracts.kit.interrupt import Interrupted, Interruptible

LOOPS = ["asyncio", "uvloop"]


def run(coro, loop_kind: str):
    return uvloop.run(coro) if loop_kind == "uvloop" else asyncio.run(coro)


async def stubborn():
    """Awaited code that catches its cancellation and returns."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return "swallowed"


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_an_interrupt_ends_the_wait_and_leaves_the_task_uncancelled(loop_kind):
    async def main():
        guard = Interruptible()
        asyncio.get_running_loop().call_later(0.02, guard.interrupt)
        with pytest.raises(Interrupted):
            await guard.wait(asyncio.sleep(10))
        task = asyncio.current_task()
        # a later limit in the same task still works as asyncio's own
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        return task.cancelling(), guard.waiting

    assert run(main(), loop_kind) == (0, False)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_outside_a_wait_an_interrupt_does_nothing(loop_kind):
    async def main():
        guard = Interruptible()
        assert guard.interrupt() is False  # never waited
        assert await guard.wait(asyncio.sleep(0, "x")) == "x"
        assert guard.interrupt() is False  # between waits
        await asyncio.sleep(0.01)
        return await guard.wait(asyncio.sleep(0.01, "y")), asyncio.current_task().cancelling()

    assert run(main(), loop_kind) == ("y", 0)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_swallowed_interrupt_is_still_an_interrupt_and_is_taken_back(loop_kind):
    """Awaited code that catches the cancellation and returns: the wait is interrupted
    all the same, the task's cancel count is back to 0, and a later cancellation from
    elsewhere is a cancellation, not mistaken for an interrupt."""

    async def main():
        guard = Interruptible()
        asyncio.get_running_loop().call_later(0.02, guard.interrupt)
        with pytest.raises(Interrupted):
            await guard.wait(stubborn())
        assert asyncio.current_task().cancelling() == 0

        async def later():
            return await guard.wait(asyncio.sleep(10))
        t = asyncio.create_task(later())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    run(main(), loop_kind)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_cancel_with_an_interrupt_stays_a_cancel(loop_kind):
    async def main():
        guard = Interruptible()

        async def waiter():
            return await guard.wait(asyncio.sleep(10))
        t = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        t.cancel()
        assert guard.interrupt() is True
        assert guard.interrupt() is False  # once per wait: one cancellation to take back
        with pytest.raises(asyncio.CancelledError):
            await t

    run(main(), loop_kind)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_deadline_whose_wait_swallows_the_expiry_raises_and_leaves_no_cancel(loop_kind):
    """MovingDeadline on the same mechanism: an expiry the awaited code swallowed still
    raises TimeoutError, and neither a flag nor a cancel count is left behind to turn a
    later wait's outcome."""

    async def main():
        d = MovingDeadline()
        with pytest.raises(TimeoutError):
            await d.within(stubborn(), 0.02)
        assert asyncio.current_task().cancelling() == 0
        value = await d.within(asyncio.sleep(0.01, "next"), 1.0)
        d.close()
        return value

    assert run(main(), loop_kind) == "next"


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_task_waiting_now_is_the_one_interrupted(loop_kind):
    """A stream's first item is awaited by a request's handler and the rest by the task
    writing the response: an interrupt reaches whichever task waits at that moment."""
    async def main():
        guard = Interruptible()
        assert await guard.wait(asyncio.sleep(0, "first")) == "first"  # this task

        async def writer():
            asyncio.get_running_loop().call_later(0.02, guard.interrupt)
            try:
                await guard.wait(asyncio.sleep(10))
            except Interrupted:
                return "interrupted"

        other = asyncio.create_task(writer())
        result = await asyncio.wait_for(other, 5)
        return result, asyncio.current_task().cancelling(), other.cancelling()

    assert run(main(), loop_kind) == ("interrupted", 0, 0)
