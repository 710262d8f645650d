"""A mocker child's stream: its chunks in order, a stall refused by name within the idle
limit, a slow but steady stream never cut, and the stream dropped when the reader stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.components.engines.mocker.children import EngineChild, EngineStalled


class Item:
    """An item as Dynamo's client yields it: ``data`` a method (annotated) or a value."""

    def __init__(self, data, as_method: bool) -> None:
        self.data = (lambda: data) if as_method else data


class Stream:
    def __init__(self, chunks: list[dict], gap_s: float, stall_after: int | None) -> None:
        self.chunks, self.gap_s, self.stall_after = chunks, gap_s, stall_after
        self.sent = 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.stall_after is not None and self.sent >= self.stall_after:
            try:
                await asyncio.sleep(3600)
            finally:
                self.closed = True
        if self.sent >= len(self.chunks):
            raise StopAsyncIteration
        await asyncio.sleep(self.gap_s)
        chunk = self.chunks[self.sent]
        self.sent += 1
        return Item(chunk, as_method=self.sent % 2 == 0)


class Client:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.calls: list[tuple[dict, int]] = []

    async def direct(self, request: dict, instance_id: int) -> Stream:
        self.calls.append((request, instance_id))
        return self.stream


def child(stream: Stream) -> EngineChild:
    return EngineChild(role="decode", mode="decode", proc=None, endpoint="e",  # type: ignore[arg-type]
                       instance_id=7, client=Client(stream))


CHUNKS = [{"token_ids": [i], "finish_reason": None} for i in range(5)]


async def read(c: EngineChild, idle_s: float) -> list[dict]:
    return [chunk async for chunk in c.stream({"x": 1}, idle_s)]


def test_chunks_come_in_order_whatever_the_item_form():
    c = child(Stream(CHUNKS, 0.0, None))
    assert asyncio.run(read(c, 1.0)) == CHUNKS
    assert c.client.calls == [({"x": 1}, 7)]


def test_a_stall_is_refused_by_name_within_the_idle_limit():
    stream = Stream(CHUNKS, 0.0, stall_after=2)
    c = child(stream)
    got: list[dict] = []

    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(EngineStalled, match="decode engine sent nothing for 0.3s"):
            async for chunk in c.stream({}, 0.3):
                got.append(chunk)
        return time.monotonic() - t0

    took = asyncio.run(main())
    assert got == CHUNKS[:2]
    assert 0.25 < took < 5.0
    assert stream.closed  # the stalled wait was cancelled, not left behind


def test_a_steady_stream_slower_in_total_than_the_limit_is_not_cut():
    # Each chunk within the limit, the whole stream well past it: the limit is per
    # chunk, moved at each one.
    assert asyncio.run(read(child(Stream(CHUNKS * 3, 0.05, None)), 0.2)) == CHUNKS * 3


def test_a_cancelled_reader_stays_cancelled():
    stream = Stream(CHUNKS, 0.0, stall_after=1)

    async def main() -> None:
        task = asyncio.ensure_future(read(child(stream), 30.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stream.closed
