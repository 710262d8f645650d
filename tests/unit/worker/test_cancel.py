"""A stopped request context ends the worker's stream and aborts the engine's request
at once, whether or not a token is on its way (a remote prefill in flight, a long
prompt being prefilled)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.engine import TokenDelta
from splitserve.components.worker.agg import stream_chunks
from splitserve.components.worker.cancel import until_stopped
from splitserve.components.worker.kv_moves import DrainCut
from splitserve.contracts.kit.worker_metrics import WorkerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


class Context:
    """The part of Dynamo's request ``Context`` the shells use."""

    def __init__(self) -> None:
        self._stopped = asyncio.get_running_loop().create_future()

    def stop_generating(self) -> None:
        if not self._stopped.done():
            self._stopped.set_result(True)

    def is_stopped(self) -> bool:
        return self._stopped.done()

    def async_killed_or_stopped(self):
        return asyncio.shield(self._stopped)


class Engine:
    """A stream that yields ``first`` items, then waits (no token comes) until closed."""

    def __init__(self, first: int, gap_s: float = 3600.0) -> None:
        self.first, self.gap_s = first, gap_s
        self.aborted = asyncio.Event()

    async def stream(self):
        try:
            for i in range(self.first):
                yield TokenDelta((i,))
            while True:
                await asyncio.sleep(self.gap_s)
                yield TokenDelta((0,))
        finally:
            self.aborted.set()


@pytest.mark.parametrize("tokens_before_stop", [0, 3])
async def test_stop_aborts_while_no_token_is_coming(tokens_before_stop):
    ctx, engine = Context(), Engine(tokens_before_stop)
    got: list = []

    async def consume():
        async for d in until_stopped(engine.stream(), ctx):
            got.append(d)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    ctx.stop_generating()
    await asyncio.wait_for(task, 1)  # ends by itself, quietly
    assert engine.aborted.is_set()
    assert len(got) == tokens_before_stop


async def test_a_stream_that_ends_is_passed_through_whole():
    ctx = Context()

    async def three():
        for i in range(3):
            yield i

    assert [x async for x in until_stopped(three(), ctx)] == [0, 1, 2]
    assert [x async for x in until_stopped(three(), None)] == [0, 1, 2]


async def test_engine_errors_still_reach_the_caller():
    async def failing():
        yield 1
        raise RuntimeError("engine died")

    got = []
    with pytest.raises(RuntimeError, match="engine died"):
        async for x in until_stopped(failing(), Context()):
            got.append(x)
    assert got == [1]


@pytest.mark.parametrize("stopped_too", [False, True], ids=["cancel", "stop-and-cancel"])
async def test_cancelling_the_caller_is_not_swallowed(stopped_too):
    """A cancel stays a cancel, also when the context's stop comes with it."""
    ctx, engine = Context(), Engine(0)

    async def consume():
        async for _ in until_stopped(engine.stream(), ctx):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    if stopped_too:
        ctx.stop_generating()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.aborted.is_set()


async def test_vllm_shell_counts_nothing_finished_when_stopped_mid_stream():
    ctx, engine = Context(), Engine(2, gap_s=0.01)
    metrics = WorkerMetrics()
    chunks = []
    async for c in stream_chunks(engine.stream(), metrics, ctx):
        chunks.append(c)
        if len(chunks) == 2:
            ctx.stop_generating()
    assert engine.aborted.is_set()
    assert all(c.get("finish_reason") is None for c in chunks)
    assert len(chunks) <= 3


async def test_a_drain_cut_ends_the_stream_with_a_drained_chunk_and_aborts():
    """The worker's drain deadline passed (``ComponentContext.drain_cut`` set): a stream
    still running ends with the ``drained`` chunk, no finish reason, engine aborted."""
    ctx, engine, cut = Context(), Engine(2, gap_s=3600), asyncio.Event()
    metrics = WorkerMetrics()
    chunks: list[dict] = []

    async def consume():
        async for c in stream_chunks(engine.stream(), metrics, ctx, DrainCut(cut)):
            chunks.append(c)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    cut.set()
    await asyncio.wait_for(task, 1)
    assert engine.aborted.is_set()
    assert chunks[-1] == {"token_ids": [], "drained": True}
    assert [c.get("finish_reason") for c in chunks] == [None, None, None]
    assert metrics.requests.labels("drained")._value.get() == 1



async def test_a_stop_between_items_ends_at_the_next_read_and_closes_the_stream():
    ctx, engine = Context(), Engine(5, gap_s=3600)
    got: list = []
    async for d in until_stopped(engine.stream(), ctx):
        got.append(d)
        if len(got) == 2:
            ctx.stop_generating()
            await asyncio.sleep(0)  # the stop's callbacks run while no read waits
            await asyncio.sleep(0)
    assert len(got) == 2
    assert engine.aborted.is_set()


async def test_a_quiet_stop_leaves_the_reading_task_uncancelled():
    """The stop cancels the read it interrupts and takes that cancellation back: the
    task goes on (the shell sends its last chunk), and a later time limit in the same
    task still works."""
    ctx, engine = Context(), Engine(1)

    async def consume() -> str:
        async for _ in until_stopped(engine.stream(), ctx):
            pass
        assert asyncio.current_task().cancelling() == 0
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)
        except TimeoutError:
            return "timed out"
        return "not timed out"

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    ctx.stop_generating()
    assert await asyncio.wait_for(task, 1) == "timed out"
    assert engine.aborted.is_set()


async def test_a_stop_as_an_item_arrives_ends_the_stream_without_it_reaching_the_caller():
    ctx = Context()
    closed = asyncio.Event()

    async def source():
        try:
            yield 1
            ctx.stop_generating()  # the stop's callback is queued before this item's read
            await asyncio.sleep(0)
            yield 2
            await asyncio.sleep(3600)
        finally:
            closed.set()

    got = [x async for x in until_stopped(source(), ctx)]
    assert got[0] == 1 and len(got) <= 2
    assert closed.is_set()
