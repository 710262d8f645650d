"""Admission in the routing service, as the router process and an in-process frontend run
it: the one-line form, a TPOT refusal answered with its reason, a miss on the policy's
pick moved to another worker, shadow mode placing everything, and explain recording
nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.contracts.wire import RouteCall
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig
from tests.unit.router.fakes import FakeClient, teach

pytestmark = pytest.mark.unit


def service(mode: str = "enforce", ids=(1, 2)) -> RouterService:
    qos = QosConfig.model_validate({
        "mode": mode, "low_priority_threshold_ms": 0,
        "classes": [{"name": "default", "ttft_ms": 2000, "tpot_ms": 50, "may_reject": True}]})
    cfg = RouterComponentConfig(policy="round_robin", qos=qos)
    return RouterService(cfg, load_policy(cfg), FakeClient(ids))


def run(svc: RouterService, rid: str, explain: bool = False) -> dict:
    async def go() -> dict:
        call = RouteCall(request_id=rid, token_ids=list(range(10)), explain=explain)
        async for reply in svc.route(call.model_dump()):
            return reply
        raise AssertionError("no reply")
    return asyncio.run(go())


def fill(svc: RouterService, n: int) -> list[dict]:
    return [run(svc, f"r{i}") for i in range(n)]


def test_the_one_line_form_validates_in_the_router_section():
    cfg = RouterComponentConfig.model_validate({"policy": "kv_aware", "block_size": 64, "qos": {
        "classes": [{"name": "default", "ttft_ms": 2000, "tpot_ms": 50, "may_reject": True}],
        "low_priority_threshold_ms": 0}})
    assert cfg.qos.classes[0].may_degrade is False and cfg.qos.mode == "enforce"


def test_a_tpot_miss_is_refused_with_its_reason_once_no_worker_meets_it():
    svc = service()
    teach(svc, 1)
    replies = fill(svc, 14)  # 7 per worker: 50 ms each, at the target
    assert all(r["worker_id"] in (1, 2) for r in replies), replies
    refused = run(svc, "probe")
    assert refused["worker_id"] is None
    assert refused["reason"] == "rejected-tpot-slo-risk"
    assert refused["retry_after_s"] == 1
    assert refused["qos"]["est_tpot_ms"] == pytest.approx(55.0, rel=0.05)


def test_a_miss_on_the_pick_goes_to_a_worker_that_meets_the_targets():
    svc = service()
    teach(svc, 1)
    for i in range(7):  # worker 1 full; round robin would put every other one there
        svc.qos.predictor.place(f"full{i}", "1", svc.qos.predictor.predict("1", 10, 0.0),
                                time.monotonic(), class_name="default")
    placed = [run(svc, f"r{i}") for i in range(4)]
    assert [r["worker_id"] for r in placed] == [2, 2, 2, 2]
    assert "qos-rerouted" in {r["reason"] for r in placed}


def test_shadow_mode_places_what_enforce_would_refuse():
    svc = service("shadow")
    teach(svc, 1)
    replies = fill(svc, 30)
    assert all(r["worker_id"] in (1, 2) for r in replies)
    assert any(r["qos"]["would_reject"] for r in replies)
    assert not any(r["reason"] == "qos-rerouted" for r in replies)


def test_explain_records_no_placement():
    svc = service()
    teach(svc, 1)
    before = dict(svc.qos.predictor.tickets)
    reply = run(svc, "x", explain=True)
    assert reply["worker_id"] in (1, 2)
    assert svc.qos.predictor.tickets == before and not svc.fleet.placed
