"""A worker a frontend could not reach leaves routing at once, and comes back when seen
alive; the router's status names exactly the workers it would route to."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.wire import RouteCall, WorkerLoad
from splitserve.components.router.fleet import FleetState
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig

pytestmark = pytest.mark.unit


class Discovery:
    """The worker client's instance list, as the router's discovery sees it."""

    def __init__(self, ids):
        self.ids = list(ids)

    def instance_ids(self):
        return list(self.ids)


def service(ids=(1, 2), **cfg) -> RouterService:
    c = RouterComponentConfig(policy="round_robin", use_kv_events=False, **cfg)
    return RouterService(c, load_policy(c), Discovery(ids), worker_endpoint="ns.worker.generate")


def call(rid: str, failed=()) -> RouteCall:
    return RouteCall(request_id=rid, token_ids=[1, 2, 3], failed_workers=list(failed))


def metric(svc: RouterService, name: str) -> float:
    return svc.metrics.registry.get_sample_value(name) or 0.0


def drain(agen) -> list:
    async def go():
        return [x async for x in agen]
    return asyncio.run(go())


def test_a_retry_naming_a_failed_worker_takes_it_out_of_routing_at_once():
    svc = service()
    reply, _ = svc.decide(call("r", failed=[1]))
    assert reply.worker_id == 2
    assert {svc.decide(call(f"n{i}"))[0].worker_id for i in range(4)} == {2}
    assert svc.status().workers == [2]
    assert metric(svc, "splitserve_router_workers_marked_down_total") == 1


def test_a_release_saying_unreachable_marks_the_worker_down():
    svc = service()
    drain(svc.release({"request_id": "x", "worker_id": 2, "outcome": "unreachable"}))
    assert svc.status().workers == [1]
    drain(svc.release({"request_id": "y", "worker_id": 1, "outcome": "error"}))
    assert svc.status().workers == [1]


def test_when_every_worker_failed_there_is_no_worker():
    svc = service(ids=(1,))
    reply, _ = svc.decide(call("r", failed=[1]))
    assert reply.worker_id is None and reply.reason == "no-workers"
    assert svc.status().workers == []


@pytest.mark.parametrize("event, back", [
    ("report-too-soon", False),   # a report already in flight when the worker died
    ("report-later", True),       # the worker is alive after all
    ("left-discovery", False),    # gone for good: the mark is forgotten with it
    ("ttl-passed", True),         # engines that report nothing come back after the TTL
])
def test_the_mark_lifts_only_when_the_worker_is_seen_alive(event, back):
    f = FleetState(down_ttl_s=30, down_grace_s=1.0)
    f.set_live([1, 2])
    f.mark_down(1, now=10.0)
    now = 10.0
    if event == "report-too-soon":
        f.report(WorkerLoad(worker_id=1), now=10.2)
    elif event == "report-later":
        f.report(WorkerLoad(worker_id=1), now=12.0)
    elif event == "left-discovery":
        f.set_live([2])
        assert f.down == {}
    else:
        now = 41.0
    assert (1 in f.candidates(now)) is back
    assert (1 in [w.worker_id for w in f.workers(now)]) is back


def test_draining_workers_are_not_candidates():
    f = FleetState()
    f.set_live([1, 2])
    f.report(WorkerLoad(worker_id=2, draining=True), now=1.0)
    assert f.candidates(1.0) == [1]


def test_status_follows_discovery():
    svc = service(ids=())
    assert svc.status().workers == [] and svc.status().endpoint == "ns.worker.generate"
    svc.client.ids = [5]
    assert svc.status().workers == [5]


def test_a_down_worker_is_skipped_even_when_it_holds_the_whole_prefix():
    class Index:
        def overlap(self, hashes):
            return {1: len(hashes)}

    c = RouterComponentConfig(policy="kv_aware", use_kv_events=False)
    svc = RouterService(c, load_policy(c), Discovery([1, 2]), Index(),
                        hash_blocks=lambda tokens, lora=None: [7, 8, 9])
    assert svc.decide(call("a"))[0].worker_id == 1
    assert svc.decide(call("b", failed=[1]))[0].worker_id == 2
