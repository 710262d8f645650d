"""The router's admission queue in the service: a free slot goes to the least-slack
waiter, a rejectable request whose deadline passes while waiting is shed."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.wire import ReleaseCall, RouteCall
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import load_policy
from splitserve.components.router.service_config import RouterComponentConfig

pytestmark = pytest.mark.unit


class FakeClient:
    def instance_ids(self):
        return [1]


def service(ttft_low_ms: float = 5000) -> RouterService:
    qos = QosConfig.model_validate({
        "classes": [
            {"name": "high", "ttft_ms": 1000, "tpot_ms": 100, "may_reject": False,
             "may_degrade": False},
            {"name": "low", "ttft_ms": ttft_low_ms, "tpot_ms": 250, "may_reject": True,
             "may_degrade": False}],
        "default_class": "low",
        "queue": {"max_inflight_per_worker": 1, "max_wait_s": 2.0}})
    cfg = RouterComponentConfig(policy="round_robin", qos=qos)
    return RouterService(cfg, load_policy(cfg), FakeClient())


async def route(svc: RouterService, rid: str, priority: str = "low") -> dict:
    call = RouteCall(request_id=rid, token_ids=list(range(32)), priority=priority)
    async for reply in svc.route(call.model_dump()):
        return reply
    raise AssertionError("no reply")


async def release(svc: RouterService, rid: str) -> None:
    call = ReleaseCall(request_id=rid, worker_id=1, outcome="cancelled")
    [_ async for _ in svc.release(call.model_dump())]


def test_free_slot_goes_to_the_least_slack_waiter():
    async def scenario():
        svc = service()
        first = await route(svc, "a")
        assert first["worker_id"] == 1
        order: list[str] = []

        async def waiting(rid, prio):
            reply = await route(svc, rid, prio)
            order.append(rid)
            return reply

        low = asyncio.create_task(waiting("b-low", "low"))     # deadline +5 s
        await asyncio.sleep(0.01)
        high = asyncio.create_task(waiting("c-high", "high"))  # deadline +1 s: less slack
        await asyncio.sleep(0.01)
        assert order == [] and len(svc.admission.queue) == 2
        await release(svc, "a")
        assert (await high)["worker_id"] == 1
        await release(svc, "c-high")
        assert (await low)["worker_id"] == 1
        assert order == ["c-high", "b-low"]
    asyncio.run(scenario())


def test_a_rejectable_request_whose_deadline_passes_while_waiting_is_shed():
    async def scenario():
        svc = service(ttft_low_ms=100)
        assert (await route(svc, "a"))["worker_id"] == 1
        reply = await route(svc, "b")  # waits 0.1 s, nobody releases
        assert reply["worker_id"] is None
        assert reply["reason"] == "rejected-deadline-passed"
        assert reply["retry_after_s"] == 1
        assert len(svc.admission.queue) == 0
        shed = [s for m in svc.qos.metrics.verdicts.collect() for s in m.samples
                if s.name.endswith("_total") and s.labels["reason"] == "deadline-passed"]
        assert shed and shed[0].value == 1
    asyncio.run(scenario())


def test_queue_off_by_default_places_over_any_count():
    async def scenario():
        svc = RouterService(RouterComponentConfig(policy="round_robin"),
                            load_policy(RouterComponentConfig(policy="round_robin")),
                            FakeClient())
        for i in range(5):
            assert (await route(svc, f"r{i}"))["worker_id"] == 1
    asyncio.run(scenario())


def test_a_caller_that_gives_up_while_waiting_leaves_no_waiter_and_no_slot_behind():
    async def scenario():
        svc = service()
        assert (await route(svc, "a"))["worker_id"] == 1
        gave_up = asyncio.create_task(route(svc, "b"))
        await asyncio.sleep(0.01)
        gave_up.cancel()
        await asyncio.gather(gave_up, return_exceptions=True)
        assert len(svc.admission.queue) == 0
        await release(svc, "a")
        assert svc.admission.reserved == 0
        assert (await route(svc, "c"))["worker_id"] == 1  # the slot is free again
    asyncio.run(scenario())


def test_a_request_leaving_the_queue_is_placed_even_when_newcomers_would_be_rejected():
    async def scenario():
        svc = service()
        for i in range(6):  # measured TTFT and TPOT on the worker
            assert (await route(svc, f"t{i}"))["worker_id"] == 1
            done = ReleaseCall(request_id=f"t{i}", worker_id=1, prompt_tokens=32,
                               output_tokens=8, ttft_s=0.5, duration_s=1.0)
            [_ async for _ in svc.release(done.model_dump())]
        assert (await route(svc, "a"))["worker_id"] == 1
        waiting = asyncio.create_task(route(svc, "b"))  # admitted, queued behind "a"
        await asyncio.sleep(0.01)
        assert len(svc.admission.queue) == 1
        # From now on a newcomer of class low is rejected: its target is 1 ms.
        strict = svc.qos.config.model_copy(update={
            "classes": tuple(c.model_copy(update={"ttft_ms": 1.0}) if c.name == "low" else c
                             for c in svc.qos.config.classes),
            "low_priority_threshold_ms": 0.0})
        svc.qos.reconfigure(strict)
        assert (await route(svc, "probe"))["reason"] == "rejected-ttft-slo-risk"
        await release(svc, "a")
        reply = await asyncio.wait_for(waiting, 1.0)
        assert reply["worker_id"] == 1  # placed on the verdict it was admitted with
        assert svc.admission.reserved == 0
    asyncio.run(scenario())
