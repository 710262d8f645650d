"""The vLLM worker's stream: wire chunks from engine deltas, and cancellation reaching
the engine's iterator (which aborts the request in vLLM)."""

from __future__ import annotations

import pytest

from splitserve.components.engines.interface import TokenDelta
from splitserve.components.engines.vllm.worker import stream_chunks
from splitserve.components.worker.metrics import WorkerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


class Deltas:
    """An engine stream that records whether its consumer closed it."""

    def __init__(self, deltas, fail: Exception | None = None) -> None:
        self.deltas, self.fail, self.closed = deltas, fail, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            for d in self.deltas:
                yield d
            if self.fail:
                raise self.fail
        finally:
            self.closed = True

    async def aclose(self) -> None:
        self.closed = True


async def test_chunks_carry_tokens_finish_reason_and_usage():
    src = Deltas([TokenDelta((1, 2)), TokenDelta((3,), True, "length", 5, 128)])
    chunks = [c async for c in stream_chunks(src, WorkerMetrics())]
    assert chunks[0] == {"token_ids": [1, 2]}
    assert chunks[1]["token_ids"] == [3] and chunks[1]["finish_reason"] == "length"
    usage = chunks[1]["completion_usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 5
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128


@pytest.mark.parametrize("reason, wire", [("stop", "eos"), ("abort", "cancelled")])
async def test_finish_reasons_map_to_the_wire(reason, wire):
    src = Deltas([TokenDelta((7,), True, reason, 1, 0)])
    chunks = [c async for c in stream_chunks(src, WorkerMetrics())]
    assert chunks[-1]["finish_reason"] == wire


async def test_consumer_going_away_closes_the_engine_stream():
    src = Deltas([TokenDelta((i,)) for i in range(100)])
    out = stream_chunks(src, WorkerMetrics())
    assert (await out.__anext__())["token_ids"] == [0]
    await out.aclose()  # what the runtime does when the client disconnects
    assert src.closed


async def test_engine_failure_becomes_an_error_chunk():
    src = Deltas([TokenDelta((1,))], fail=RuntimeError("engine died"))
    chunks = [c async for c in stream_chunks(src, WorkerMetrics())]
    assert chunks[-1]["finish_reason"] == "error" and "engine died" in chunks[-1]["error"]


class _Ctx:
    def __init__(self) -> None:
        import asyncio

        self.stopping = asyncio.Event()
        self.reports: list = []

    def report(self, state, **fields) -> None:
        self.reports.append(state)


class _Endpoint:
    async def unregister_endpoint_instance(self) -> None:
        pass


class _Engine:
    def __init__(self, healthy_polls: int) -> None:
        self.polls, self.healthy_polls = 0, healthy_polls

    def failure(self):
        self.polls += 1
        return None if self.polls <= self.healthy_polls else RuntimeError("core died")


async def test_dead_engine_makes_the_worker_leave():
    from splitserve.components.engines.vllm.worker import watch_engine

    left: list = []

    async def leave(exc, report, deregister):
        left.append(exc)

    await watch_engine(_Ctx(), _Engine(healthy_polls=2), _Endpoint(), interval_s=0.01,
                       leave=leave)
    assert len(left) == 1 and "core died" in str(left[0])


async def test_stopping_worker_does_not_leave():
    import asyncio

    from splitserve.components.engines.vllm.worker import watch_engine

    ctx, left = _Ctx(), []

    async def leave(exc, report, deregister):
        left.append(exc)

    task = asyncio.create_task(watch_engine(ctx, _Engine(healthy_polls=10**9), _Endpoint(),
                                            interval_s=0.01, leave=leave))
    await asyncio.sleep(0.05)
    ctx.stopping.set()
    await asyncio.wait_for(task, 2)
    assert left == []
