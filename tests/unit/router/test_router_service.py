"""Router process logic without the network: fleet bookkeeping and route/release calls."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.wire import ReleaseCall, RouteCall, WorkerLoad
from splitserve.components.router.fleet import FleetState
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig
from tests.unit.router.fakes import FakeClient

pytestmark = pytest.mark.unit


class FakeIndexer:
    """Stands in for the KV event index: fixed cached-block counts per worker."""

    def __init__(self, scores):
        self._scores = scores

    def overlap(self, hashes):
        return {w: min(n, len(hashes)) for w, n in self._scores.items()}


def hashes(tokens, lora=None):
    return [hash((lora, *tokens[: i + 16]))
            for i in range(0, len(tokens) - len(tokens) % 16, 16)]


def service(policy="kv_aware", ids=(1, 2, 3), scores=None):
    cfg = RouterComponentConfig(policy=policy)
    return RouterService(cfg, load_policy(cfg), FakeClient(ids),
                         FakeIndexer(scores or {}), hash_blocks=hashes)


def call(rid, n=64, explain=False):
    return RouteCall(request_id=rid, token_ids=list(range(n)), explain=explain)


def test_fleet_inflight_and_release():
    f = FleetState(inflight_ttl_s=10)
    f.set_live([1, 2])
    f.place("a", 1, now=0)
    f.place("b", 1, now=0)
    assert {w.worker_id: w.active_requests for w in f.workers(0)} == {1: 2, 2: 0}
    assert f.release("a") == 1 and f.release("a") is None
    assert f.expire(now=11) == 1
    assert f.workers(11)[0].active_requests == 0


def test_fleet_placing_a_request_again_moves_its_load():
    f = FleetState(inflight_ttl_s=10)
    f.set_live([1, 2])
    f.place("a", 1, now=0)
    f.place("a", 2, now=1)  # routed again (its first worker failed)
    assert {w.worker_id: w.active_requests for w in f.workers(1)} == {1: 0, 2: 1}
    assert f.release("a") == 2
    assert {w.worker_id: w.active_requests for w in f.workers(1)} == {1: 0, 2: 0}


def test_fleet_expire_drops_exactly_the_old_placements():
    f = FleetState(inflight_ttl_s=10)
    f.set_live([1])
    for i in range(100):
        f.place(f"r{i}", 1, now=i * 0.1)  # 0.0 .. 9.9
    f.place("r0", 1, now=10.0)  # placed again: young now
    assert f.expire(now=15.05) == 50  # r1 .. r50 are older than 10 s
    assert sorted(f.placed) == sorted(["r0", *(f"r{i}" for i in range(51, 100))])
    # A clock that went back (placements out of order): still every old one, none else.
    f.place("late", 1, now=2.0)
    assert f.expire(now=12.5) == 1 and "late" not in f.placed and len(f.placed) == 50
    assert f.expire(now=100) == 50 and f.workers(100)[0].active_requests == 0


def test_a_late_release_of_a_migrated_request_keeps_its_new_placement():
    """The frontend releases a placement in the background: a request migrated to
    another worker can be placed again before the release of its first placement
    arrives, and that release must not end the new one."""
    svc = service(scores={3: 4})
    first = svc.decide(call("m"))[0].worker_id
    again = svc.decide(call("m").model_copy(update={"failed_workers": [first]}))[0].worker_id
    assert again != first
    svc.complete(ReleaseCall(request_id="m", worker_id=first, outcome="unreachable"))
    assert svc.fleet.placed["m"].worker_id == again
    assert svc.qos.predictor.tickets["m"].worker == f"{again:x}"
    svc.complete(ReleaseCall(request_id="m", worker_id=again, outcome="ok"))
    assert "m" not in svc.fleet.placed and "m" not in svc.qos.predictor.tickets
    assert all(w.active_requests == 0 for w in svc.fleet.workers(0))


def test_fleet_merges_reports_and_drops_dead_workers():
    f = FleetState()
    f.set_live([1, 2])
    f.report(WorkerLoad(worker_id=2, active=5, waiting=2, kv_used_blocks=30,
                        kv_total_blocks=100), now=1.0)
    f.place("x", 2, now=1.0)
    w2 = f.workers(3.0)[1]
    assert (w2.active_requests, w2.waiting_requests, w2.kv_usage, w2.last_seen_s) == \
        (5, 2, 0.3, 2.0)
    f.set_live([1])
    assert [w.worker_id for w in f.workers(3.0)] == [1]
    assert f.snapshot(3.0, {2: 4}, {}).overlap_blocks == {}


def test_kv_aware_prefers_cached_worker_and_accounts_load():
    svc = service(scores={2: 4})
    reply, decision = svc.decide(call("r1"))
    assert reply.worker_id == 2 and reply.reason == "picked"
    assert svc.fleet.inflight == {2: 1}
    assert asyncio.run(_drain(svc.release({"request_id": "r1", "worker_id": 2}))) == [{"ok": True}]
    assert svc.fleet.inflight == {2: 0}


def test_explain_does_not_record():
    svc = service(scores={3: 4})
    reply, _ = svc.decide(call("e", explain=True))
    assert reply.worker_id == 3 and reply.decision["scorers"]
    assert svc.fleet.placed == {} and len(svc.tracker) == 0


def test_explain_endpoint_never_records_whatever_it_is_sent():
    """The frontend's explain endpoint (in-process routing) forces explain on: a call
    asking to be recorded, or not to explain, is still only described."""
    svc = service(scores={3: 4})
    body = call("e").model_dump(mode="json") | {"explain": False, "record": True}
    out = asyncio.run(_drain(svc.explain(body)))
    assert out[0]["worker_id"] == 3 and out[0]["decision"]["scorers"]
    assert svc.fleet.placed == {} and len(svc.tracker) == 0
    bad = asyncio.run(_drain(svc.explain({"request_id": 5})))
    assert bad[0]["worker_id"] is None and bad[0]["reason"].startswith("bad-request")
    assert asyncio.run(_drain(svc.explain([1, 2])))[0]["reason"].startswith("bad-request")


def test_round_robin_spreads():
    svc = service("round_robin")
    picks = [svc.decide(call(f"r{i}"))[0].worker_id for i in range(6)]
    assert sorted(set(picks)) == [1, 2, 3] and picks[:3] != picks[3:4] * 3


def test_no_workers_gives_reason():
    svc = service(ids=())
    reply, _ = svc.decide(call("r"))
    assert reply.worker_id is None and reply.reason == "no-workers"


def test_bad_route_call_answers_instead_of_raising():
    svc = service()
    out = asyncio.run(_drain(svc.route({"request_id": 5})))
    assert out[0]["worker_id"] is None and out[0]["reason"].startswith("bad-request")


async def _drain(agen):
    return [x async for x in agen]
