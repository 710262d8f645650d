"""The aggregated shell's stream: wire chunks from engine deltas, cancellation reaching
the engine's iterator (which aborts the request in the engine), and an engine's death
ending the replica."""

from __future__ import annotations

import pytest

from splitserve.contracts.engine import TokenDelta
from splitserve.contracts.wire import FinishReason
from splitserve.components.worker.agg import stream_chunks
from splitserve.contracts.kit.worker_metrics import WorkerMetrics

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
    src = Deltas([TokenDelta((1, 2)), TokenDelta((3,), True, FinishReason.LENGTH, 5, 128)])
    chunks = [c async for c in stream_chunks(src, WorkerMetrics())]
    assert chunks[0] == {"token_ids": [1, 2]}
    assert chunks[1]["token_ids"] == [3] and chunks[1]["finish_reason"] == "length"
    usage = chunks[1]["completion_usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 5
    assert usage["prompt_tokens_details"]["cached_tokens"] == 128


@pytest.mark.parametrize("reason, wire", [(FinishReason.EOS, "eos"),
                                          (FinishReason.CANCELLED, "cancelled"),
                                          (None, "eos")])
async def test_finish_reasons_go_on_the_wire_and_into_the_outcome_count(reason, wire):
    src = Deltas([TokenDelta((7,), True, reason, 1, 0)])
    metrics = WorkerMetrics()
    chunks = [c async for c in stream_chunks(src, metrics)]
    assert chunks[-1]["finish_reason"] == wire
    assert metrics.requests.labels(wire)._value.get() == 1


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


def _info(reports_failure: bool):
    from splitserve.contracts.engine import EngineCapabilities, EngineInfo

    return EngineInfo(name="vllm", kv_block_size=16, capabilities=EngineCapabilities(
        local_prefill=True, pushes_kv=False, handoff_before_prefill=False,
        prefix_lookup=False, moves_kv=False, reports_failure=reports_failure))


class _Engine:
    def __init__(self, healthy_polls: int, reports_failure: bool = True) -> None:
        self.polls, self.healthy_polls = 0, healthy_polls
        self.info = _info(reports_failure)

    def failure(self):
        self.polls += 1
        return None if self.polls <= self.healthy_polls else RuntimeError("core died")


async def test_dead_engine_ends_the_replica_with_its_error():
    from splitserve.contracts.kit.hosting import watch_failure

    exc = await watch_failure(_Engine(healthy_polls=2), every_s=0.01)
    assert "vllm engine failed" in str(exc) and "core died" in str(exc)


async def test_an_engine_that_cannot_tell_never_ends_the_replica():
    import asyncio

    from splitserve.contracts.kit.hosting import watch_failure

    engine = _Engine(healthy_polls=0, reports_failure=False)  # it would fail at once
    task = asyncio.ensure_future(watch_failure(engine, every_s=0.01))
    await asyncio.sleep(0.05)
    assert not task.done() and engine.polls == 0  # its capabilities say it cannot tell
    task.cancel()
