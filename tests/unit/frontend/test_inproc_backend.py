"""The frontend's in-process routing (``Frontend.routing: in_process``) against fake
worker clients and a real RouterService: placement and release without any RPC, a
failed worker marked down, readiness, and the admission queue's 503."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.components.frontend.backend import BackendMetrics, StreamMeta
from splitserve.components.frontend.errors import APIError
from splitserve.components.frontend.inproc import InProcessBackend
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig
from tests.unit.frontend.test_backend import ENDPOINT, Workers, request

pytestmark = pytest.mark.unit


def in_process(workers: Workers, queue: dict | None = None, route_timeout_s: float = 5.0,
               migration_limit: int = 1) -> tuple[InProcessBackend, RouterService]:
    cfg = RouterComponentConfig.model_validate(
        {"policy": "round_robin", "use_kv_events": False, "qos": {"queue": queue or {}}})
    svc = RouterService(cfg, load_policy(cfg), workers, worker_endpoint=ENDPOINT)
    backend = InProcessBackend(svc, workers, route_timeout_s=route_timeout_s,
                               migration_limit=migration_limit, metrics=BackendMetrics())
    return backend, svc


def released(svc: RouterService, outcome: str) -> float:
    return svc.metrics.registry.get_sample_value(
        "splitserve_router_released_total", {"outcome": outcome}) or 0.0


async def collect(backend, rid: str = "r") -> list[dict]:
    return [c async for c in backend.stream(request(), StreamMeta(rid, None), None)]


def test_each_request_is_placed_and_released_in_process():
    workers = Workers([1, 2])
    backend, svc = in_process(workers)

    async def go():
        for i in range(4):
            chunks = await collect(backend, f"r{i}")
            assert chunks[-1]["finish_reason"] == "length"
    asyncio.run(go())
    assert sorted(workers.sent) == [1, 1, 2, 2]
    assert svc.fleet.placed == {} and released(svc, "ok") == 4


def test_a_placement_counts_as_load_until_its_stream_closes():
    backend, svc = in_process(Workers([1]))

    async def go():
        agen = backend.stream(request(), StreamMeta("held", None), None)
        await agen.__anext__()
        assert list(svc.fleet.placed) == ["held"]
        await agen.aclose()  # the client left mid-stream
        assert svc.fleet.placed == {}
    asyncio.run(go())
    assert released(svc, "cancelled") == 1


def test_a_dead_worker_is_retried_and_marked_down_in_the_service():
    workers = Workers([1, 2], dead=[1])
    backend, svc = in_process(workers)

    async def go():
        for i in range(3):
            assert (await collect(backend, f"r{i}"))[-1]["finish_reason"] == "length"
    asyncio.run(go())
    assert workers.sent.count(1) == 1, "the dead worker must get no second request"
    assert svc.status().workers == [2]
    assert released(svc, "unreachable") == 1 and released(svc, "ok") == 3


def test_no_worker_is_a_503_with_retry_after():
    backend, _ = in_process(Workers([]))
    with pytest.raises(APIError) as err:
        asyncio.run(collect(backend))
    assert err.value.status == 503 and err.value.retry_after_s is not None


def test_ready_follows_the_workers_the_service_would_route_to():
    workers = Workers([])
    backend, svc = in_process(workers)
    assert not backend.ready(), "no worker in discovery"
    workers.ids = [7]
    assert backend.ready()
    svc.mark_down(7, time.monotonic())
    assert not backend.ready(), "the only worker was found dead"


def test_admission_queue_holds_then_refuses_with_503_and_a_release_lets_one_through():
    queue = {"max_inflight_per_worker": 1, "max_queued": 1, "max_wait_s": 4}
    backend, svc = in_process(Workers([1, 2]), queue)

    async def go():
        held = [backend.stream(request(), StreamMeta(f"h{i}", None), None) for i in range(2)]
        for agen in held:
            await agen.__anext__()  # placed: one request per worker, the cap
        waiting = asyncio.create_task(collect(backend, "waiting"))
        await asyncio.sleep(0.05)
        assert not waiting.done() and len(svc.admission.queue) == 1
        with pytest.raises(APIError) as err:
            await collect(backend, "refused")
        assert err.value.status == 503 and err.value.retry_after_s >= 1
        assert err.value.code == "rejected-queue-full"
        await held[0].aclose()  # its release hands the slot to the waiting request
        assert (await asyncio.wait_for(waiting, 2))[-1]["finish_reason"] == "length"
        await held[1].aclose()
    asyncio.run(go())
    assert svc.fleet.placed == {} and len(svc.admission.queue) == 0


def test_a_wait_past_route_timeout_is_a_503_and_leaves_no_waiter():
    queue = {"max_inflight_per_worker": 1, "max_queued": 4, "max_wait_s": 4}
    backend, svc = in_process(Workers([1]), queue, route_timeout_s=0.1)

    async def go():
        held = backend.stream(request(), StreamMeta("h", None), None)
        await held.__anext__()
        with pytest.raises(APIError) as err:
            await collect(backend, "late")
        assert err.value.status == 503 and err.value.code == "router_timeout"
        assert len(svc.admission.queue) == 0
        await held.aclose()
    asyncio.run(go())
    assert svc.fleet.placed == {} and svc.admission.reserved == 0


def test_admissions_prediction_reaches_the_request_and_its_response_header():
    from splitserve.components.frontend.app import PREDICTED_TTFT_HEADER, _predicted
    from splitserve.bench.replay import PREDICTED_TTFT_HEADER as READ_BY_THE_METER

    backend, _ = in_process(Workers([1]))
    meta = StreamMeta("r", None)

    async def go():
        return [c async for c in backend.stream(request(), meta, None)]
    asyncio.run(go())
    assert meta.predicted_ttft_ms is not None and meta.predicted_ttft_ms > 0
    assert _predicted([meta]) == {PREDICTED_TTFT_HEADER: f"{meta.predicted_ttft_ms:.0f}"}
    assert _predicted([StreamMeta("unrouted", None)]) == {}
    assert READ_BY_THE_METER == PREDICTED_TTFT_HEADER


class LongAnswers(Workers):
    """Every stream: 40 one-token chunks, the last one finished."""

    async def _stream(self, worker_id):
        for i in range(40):
            yield {"token_ids": [5], "finish_reason": "length" if i == 39 else None}


def test_progress_is_reported_every_sixteen_tokens_and_wakes_the_held_once():
    backend, svc = in_process(LongAnswers([1]))
    seen: list[tuple[int, bool]] = []
    svc.decode_progress = lambda rid, tokens, wake=True: seen.append((tokens, wake))

    async def go():
        meta = StreamMeta("r", None)
        async for _ in backend.stream(request(max_tokens=40), meta, None):
            pass
    asyncio.run(go())
    assert seen == [(16, True), (32, False)]
