"""First tokens and decode progress for a Router process: the frontend's batched feed,
and a real RouterService applying what it sends."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.components.frontend.backend import BackendMetrics, RoutedBackend, StreamMeta
from splitserve.components.frontend.progress import (
    PROGRESS_TOKENS,
    ProgressFeed,
    ProgressMetrics,
    due_reports,
)
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import RouterComponentConfig, load_policy
from splitserve.contracts.wire import ProgressReport, ReleaseCall, RouteCall

from .test_backend import ENDPOINT, RouterClient, Workers, request

pytestmark = pytest.mark.unit


class Progress:
    """A client of the routers' ``progress`` endpoint: records each batch it is sent, or
    hands it to a real service's handler."""

    def __init__(self, ids=(99,), handler=None, fail: bool = False) -> None:
        self.ids, self.handler, self.fail = list(ids), handler, fail
        self.batches: list[tuple[int, dict]] = []

    def instance_ids(self):
        return list(self.ids)

    async def direct(self, request, instance_id, context=None):
        self.batches.append((instance_id, request))
        if self.fail:
            raise ConnectionResetError("no answer")
        if self.handler is not None:
            return self.handler(request)
        return self._ok()

    async def _ok(self):
        yield {"ok": True}


def sample(feed: ProgressFeed, outcome: str) -> float:
    return feed.metrics.registry.get_sample_value(
        "splitserve_frontend_progress_reports_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize(("before", "tokens", "due", "expected"), [
    (0, 1, 16, (True, False, False, 16)),     # the first token alone
    (15, 16, 16, (False, True, True, 32)),    # the first progress report teaches a fit
    (31, 32, 32, (False, True, False, 48)),   # the later ones only record
    (0, 40, 16, (True, True, True, 48)),      # a resumed stream's first chunk of 40
    (16, 17, 32, (False, False, False, 32)),
])
def test_what_a_stream_reports(before, tokens, due, expected):
    assert due_reports(before, tokens, due) == expected
    assert PROGRESS_TOKENS == 16


def test_reports_go_in_one_batch_per_router_replica_dated_by_their_age():
    clock = [100.0]
    client = Progress(ids=[11, 12])
    feed = ProgressFeed(client, interval_s=10.0, clock=lambda: clock[0])

    async def go():
        feed.report(11, "a", 1, 1, True, False, False)
        feed.report(12, "b", 2, 1, True, False, False)
        clock[0] += 0.02
        feed.report(11, "a", 1, 16, False, True, True)
        await asyncio.sleep(0.01)
        assert client.batches == [], "nothing is sent before the interval"
        clock[0] += 0.03
        await feed.close()
    asyncio.run(go())
    by_router = {rid: body["reports"] for rid, body in client.batches}
    assert sorted(by_router) == [11, 12] and len(client.batches) == 2
    a = by_router[11]
    assert [(r["request_id"], r["worker_id"], r["tokens"], r["first_token"], r["progress"],
             r["wake"]) for r in a] == [("a", 1, 1, True, False, False),
                                        ("a", 1, 16, False, True, True)]
    assert [r["age_s"] for r in a] == [pytest.approx(0.05), pytest.approx(0.03)]
    assert sample(feed, "sent") == 3


def test_the_interval_sends_without_being_asked():
    client = Progress(ids=[11])
    feed = ProgressFeed(client, interval_s=0.01)

    async def go():
        feed.report(11, "a", 1, 1, True, False, False)
        for _ in range(500):
            if client.batches:
                break
            await asyncio.sleep(0.01)
    asyncio.run(go())
    assert len(client.batches) == 1 and sample(feed, "sent") == 1


def test_a_replica_without_the_endpoint_or_failing_costs_only_the_reports():
    async def go(feed):
        feed.report(11, "a", 1, 1, True, False, False)
        feed.report(11, "b", 1, 1, True, False, False)
        await asyncio.sleep(0.05)
        await feed.close()

    old = ProgressFeed(Progress(ids=[12]), interval_s=0.01)  # 11 serves no `progress`
    asyncio.run(go(old))
    assert old.client.batches == [] and sample(old, "unsupported") == 2
    failing = ProgressFeed(Progress(ids=[11], fail=True), interval_s=0.01)
    asyncio.run(go(failing))
    assert len(failing.client.batches) == 1 and sample(failing, "failed") == 2
    assert sample(failing, "sent") == 0


def test_pending_reports_are_bounded_and_the_oldest_dropped():
    client = Progress(ids=[11])
    feed = ProgressFeed(client, interval_s=0.01, max_pending=3)

    async def go():
        for i in range(5):
            feed.report(11, f"r{i}", 1, 1, True, False, False)
        await asyncio.sleep(0.05)
    asyncio.run(go())
    assert [r["request_id"] for _, body in client.batches for r in body["reports"]] == \
        ["r2", "r3", "r4"]
    assert sample(feed, "overflow") == 2


def test_a_report_without_its_router_or_worker_is_not_queued():
    feed = ProgressFeed(Progress(), interval_s=0.01)

    async def go():
        feed.report(None, "a", 1, 1, True, False, False)
        feed.report(99, "a", None, 1, True, False, False)
        await asyncio.sleep(0.03)
    asyncio.run(go())
    assert feed.client.batches == []


def test_close_sends_what_is_pending():
    client = Progress()
    feed = ProgressFeed(client, interval_s=10.0)

    async def go():
        feed.report(99, "a", 1, 1, True, False, False)
        await feed.close()
    asyncio.run(go())
    assert len(client.batches) == 1 and sample(feed, "sent") == 1


class LongAnswers(Workers):
    """Every stream: 40 one-token chunks, the last one finished."""

    async def _stream(self, worker_id):
        for i in range(40):
            yield {"token_ids": [5], "finish_reason": "length" if i == 39 else None}


def service(qos: QosConfig | None = None) -> RouterService:
    cfg = RouterComponentConfig(policy="round_robin", use_kv_events=False)
    if qos is not None:
        cfg = cfg.model_copy(update={"qos": qos})
    return RouterService(cfg, load_policy(cfg), Workers([1]), worker_endpoint=ENDPOINT)


def routed_with_feed(svc: RouterService, workers: Workers):
    async def connect(path):
        return workers

    backend = RoutedBackend(RouterClient(svc, svc.route), connect, metrics=BackendMetrics())
    backend.release_client = RouterClient(svc, svc.release)
    backend.progress_feed = ProgressFeed(RouterClient(svc, svc.progress), interval_s=0.005,
                                         metrics=ProgressMetrics(BackendMetrics().registry))
    return backend


def test_a_router_learns_the_first_token_and_progress_while_the_answer_streams():
    svc = service(QosConfig.model_validate(
        {"classes": [{"name": "default", "ttft_ms": 1000, "tpot_ms": 100}]}))
    backend = routed_with_feed(svc, LongAnswers([1]))
    seen: dict[str, list] = {"first": [], "progress": []}

    async def go():
        meta = StreamMeta("r", None)
        async for chunk in backend.stream(request(max_tokens=40), meta, None):
            await asyncio.sleep(0.002)  # a token every couple of milliseconds
            if chunk.get("finish_reason"):
                # Before the release: the router knows the prompt is prefilled and how
                # far the answer got.
                pace = svc.qos.predictor.progress
                for _ in range(500):
                    if pace.get("r", (0,))[0] == 32:
                        break
                    await asyncio.sleep(0.01)
                seen["first"] = dict(svc.qos.predictor.first_tokens)
                seen["progress"] = dict(pace)
        await backend.progress_feed.close()
    asyncio.run(go())
    assert list(seen["first"]) == ["r"], "the router learned the first token"
    assert 0.0 <= seen["first"]["r"] < 1000.0
    assert seen["progress"]["r"][0] == 32, "and the answer's progress at 32 tokens"
    assert svc.fleet.placed == {}


def test_the_router_dates_a_report_by_its_age_and_skips_a_stale_worker():
    svc = service(QosConfig.model_validate(
        {"classes": [{"name": "default", "ttft_ms": 1000, "tpot_ms": 100}]}))
    now = time.monotonic()
    reply = asyncio.run(svc.place(RouteCall(request_id="r", token_ids=[1, 2, 3],
                                            max_tokens=8)))
    assert reply.worker_id == 1
    placed_at = svc.qos.predictor.tickets["r"].placed_at
    stale = ProgressReport(request_id="r", worker_id=2, tokens=1, age_s=0.0,
                           first_token=True)
    assert svc.apply_progress([stale], time.monotonic()) == 0
    assert "r" not in svc.qos.predictor.first_tokens
    at = time.monotonic()
    mine = ProgressReport(request_id="r", worker_id=1, tokens=1, age_s=0.2,
                          first_token=True)
    assert svc.apply_progress([mine], at) == 1
    measured = svc.qos.predictor.first_tokens["r"]
    assert measured == pytest.approx(max(0.0, at - 0.2 - placed_at) * 1000.0)
    assert now <= placed_at
    svc.complete(ReleaseCall(request_id="r", worker_id=1))
    late = ProgressReport(request_id="r", worker_id=1, tokens=16, age_s=0.0,
                          progress=True)
    assert svc.apply_progress([late], time.monotonic()) == 0
    counts = {k: svc.metrics.registry.get_sample_value(
        "splitserve_router_progress_reports_total", {"kind": k})
        for k in ("stale", "first_token", "late")}
    assert counts == {"stale": 1.0, "first_token": 1.0, "late": 1.0}


def test_the_progress_endpoint_refuses_a_malformed_batch_and_keeps_serving():
    svc = service()

    async def call(body):
        return [x async for x in svc.progress(body)]
    bad = asyncio.run(call({"reports": [{"request_id": "r", "worker_id": 1, "tokens": 0,
                                         "age_s": 0}]}))
    assert bad[0]["ok"] is False and "tokens" in bad[0]["error"]
    assert asyncio.run(call({"reports": [], "extra": 1}))[0]["ok"] is False
    assert asyncio.run(call({"reports": []})) == [{"ok": True, "applied": 0}]
