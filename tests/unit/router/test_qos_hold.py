"""Holding instead of refusing (``qos.hold``): a request turned away for the batch it
would join waits in the router, deadline-ordered, and is placed once an answer ends or
its workers' TPOT line has been taught the batch, refused once its slack is spent (with
the predicted drain as Retry-After), and refused at once when the batches ahead cannot
drain within its slack.  A request that must be refused for its TTFT is never held."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.contracts.wire import ReleaseCall, RouteCall
from splitserve.components.router.qos import AdmissionRequest, QosConfig, admit
from splitserve.components.router.qos.hold import HoldConfig
from splitserve.components.router.qos.predictor import LatencyPredictor
from splitserve.components.router.service import RouterService
from splitserve.components.router.service_config import RouterComponentConfig, load_policy
from tests.unit.router.fakes import TAUGHT, FakeClient, teach

pytestmark = pytest.mark.unit

CLASS = {"name": "default", "ttft_ms": 2000, "tpot_ms": 50, "may_reject": True}


def service(hold: dict | None = None, mode: str = "enforce") -> RouterService:
    qos = QosConfig.model_validate({"mode": mode, "low_priority_threshold_ms": 0,
                                    "classes": [CLASS], "hold": hold or {}})
    cfg = RouterComponentConfig(policy="round_robin", qos=qos)
    return RouterService(cfg, load_policy(cfg), FakeClient((1, 2)))


def teach_both(svc: RouterService, batches=TAUGHT) -> None:
    """Finished requests on both workers (``fakes.teach``): TTFT 50 ms; TPOT 20 ms alone,
    30 ms in threes (8 running predict 55 ms, over the 50 ms target)."""
    for worker in (1, 2):
        teach(svc, worker, batches)


async def fill(svc: RouterService, n: int) -> list:
    """``n`` requests placed round robin (the replies)."""
    return [await svc.place(call(f"r{i}")) for i in range(n)]


def call(rid: str, tokens: int = 10) -> RouteCall:
    return RouteCall(request_id=rid, token_ids=list(range(tokens)))


def release(svc: RouterService, rid: str, worker: int) -> None:
    """``rid`` ends: its slot is freed and nothing is learned from it.  (Timings made up
    here would teach the TPOT line against the batch its worker held over the request's
    real life since ``fill``, so what the head is judged on after the release would hang
    on how long the test took to get there.)"""
    svc.complete(ReleaseCall(request_id=rid, worker_id=worker, output_tokens=11,
                             ttft_s=None, duration_s=None))


def held_count(svc: RouterService, outcome: str) -> float:
    return sum(s.value for m in svc.qos.metrics.held.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("outcome") == outcome)


def test_a_request_held_for_its_batch_is_placed_when_an_answer_ends():
    async def go():
        svc = service()
        teach_both(svc)
        placed = await fill(svc, 14)  # 7 per worker
        assert all(r.worker_id in (1, 2) for r in placed)
        probe = asyncio.create_task(svc.place(call("probe")))
        await asyncio.sleep(0.1)
        assert not probe.done() and len(svc.held) == 1  # held, not refused
        release(svc, "r0", placed[0].worker_id)
        reply = await asyncio.wait_for(probe, 1.0)
        assert reply.worker_id == placed[0].worker_id, reply
        assert held_count(svc, "placed") == 1 and len(svc.held) == 0
    asyncio.run(go())


def test_a_held_request_hashes_its_prompt_once_however_often_it_is_judged():
    async def go():
        svc = service()
        teach_both(svc)
        placed = await fill(svc, 14)
        hashed: list[str] = []

        def hash_blocks(tokens, lora=None):
            hashed.append(tokens[0])
            return [7, 8]
        svc.hash_blocks = hash_blocks
        probe = asyncio.create_task(svc.place(call("probe")))
        await asyncio.sleep(0.1)  # judged again on every 20 ms tick
        assert not probe.done() and len(svc.held) == 1
        release(svc, "r0", placed[0].worker_id)
        assert (await asyncio.wait_for(probe, 1.0)).worker_id == placed[0].worker_id
        assert len(hashed) == 1
    asyncio.run(go())


def judgments(svc: RouterService, result: str) -> float:
    return sum(s.value for m in svc.qos.metrics.hold_judgments.collect()
               for s in m.samples if s.name.endswith("_total")
               and s.labels.get("result") == result)


def test_arrivals_judge_the_held_head_again_only_once_something_changed():
    async def go():
        svc = service({"tick_s": 1.0})  # no tick within the test
        teach_both(svc)
        placed = await fill(svc, 14)
        head = asyncio.create_task(svc.place(call("head")))
        await asyncio.sleep(0)
        assert len(svc.held) == 1
        judged = judgments(svc, "judged")
        arrivals = [asyncio.create_task(svc.place(call(f"a{i}"))) for i in range(5)]
        await asyncio.sleep(0.05)
        # Each arrival pumped the queue before and after its own judgment; nothing the
        # head waits for changed, so it was left held, never judged again.
        assert len(svc.held) == 6
        assert judgments(svc, "judged") == judged
        assert judgments(svc, "unchanged") >= 5
        release(svc, "r0", placed[0].worker_id)  # a release: the head is judged again
        assert (await asyncio.wait_for(head, 1.0)).worker_id == placed[0].worker_id
        assert judgments(svc, "judged") > judged
        for task in arrivals:
            task.cancel()
    asyncio.run(go())


def test_a_held_head_is_judged_again_every_tick_with_nothing_changed():
    async def go():
        svc = service({"tick_s": 0.02})
        teach_both(svc)
        await fill(svc, 14)
        probe = asyncio.create_task(svc.place(call("probe")))
        for _ in range(200):  # its wait grows: judged on ticks alone
            await asyncio.sleep(0.01)
            if judgments(svc, "judged") >= 3:
                break
        assert judgments(svc, "judged") >= 3 and not probe.done()
        probe.cancel()
    asyncio.run(go())


def test_a_tick_comes_a_tick_after_the_last_judgement_and_never_after_the_hold_ends():
    async def go():
        svc = service({"tick_s": 1.0, "max_wait_s": 0.3})
        teach_both(svc)
        await fill(svc, 14)
        probe = asyncio.create_task(svc.place(call("probe")))
        await asyncio.sleep(0)
        assert len(svc.held) == 1
        assert svc.held.next_expiry() - time.monotonic() <= 0.3
        assert svc._pump_at <= svc.held.next_expiry()  # not in 1 s
        reply = await asyncio.wait_for(probe, 2.0)
        assert reply.worker_id is None and reply.reason == "rejected-tpot-slo-risk"
    asyncio.run(go())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_judgement_longer_than_a_tick_breaks_no_later_pump(loop):
    """The frontend runs on uvloop, whose answer to a timer due already is a plain
    handle: a judgement that outlasts a tick must not break the next pump."""
    import uvloop

    async def go():
        svc = service({"tick_s": 0.02})
        teach_both(svc)
        await fill(svc, 14)
        first = asyncio.create_task(svc.place(call("first")))
        await asyncio.sleep(0)
        assert len(svc.held) == 1
        decide = svc.decide

        def slow(*args, **kwargs):  # a judgement that outlasts a tick (a starved CPU)
            time.sleep(0.03)
            return decide(*args, **kwargs)
        svc.decide = slow
        svc._wake_held()  # judged again now: the next tick is due before it ends
        await asyncio.sleep(0)
        second = asyncio.create_task(svc.place(call("second")))
        await asyncio.sleep(0.1)
        assert not second.done() or second.exception() is None
        assert len(svc.held) == 2 and not first.done()
        assert held_count(svc, "failed") == 0
        for task in (first, second):
            task.cancel()
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(go())


def test_a_held_request_is_refused_when_its_wait_ends_with_the_drain_as_retry_after():
    async def go():
        svc = service({"max_wait_s": 0.2})
        teach_both(svc)
        await fill(svc, 14)
        t0 = time.monotonic()
        reply = await svc.place(call("probe"))
        waited = time.monotonic() - t0
        assert reply.worker_id is None and reply.reason == "rejected-tpot-slo-risk", reply
        assert 0.15 <= waited < 1.0
        assert reply.retry_after_s >= 1
        assert held_count(svc, "refused") == 1
    asyncio.run(go())


def test_a_ttft_refusal_is_never_held():
    async def go():
        svc = service()
        teach_both(svc)
        reply = await svc.place(call("huge", tokens=1))
        assert reply.worker_id is not None
        # 10-token prompts cost 50 ms: a queue of a thousand times that misses at once.
        svc.qos.predictor.workers["1"].pending_tokens = 1e6
        svc.qos.predictor.workers["2"].pending_tokens = 1e6
        t0 = time.monotonic()
        reply = await svc.place(call("late"))
        assert reply.reason == "rejected-ttft-slo-risk" and time.monotonic() - t0 < 0.1
        assert len(svc.held) == 0
    asyncio.run(go())


def test_a_batch_beyond_what_the_line_was_taught_is_held_until_it_is_taught():
    async def go():
        svc = service({"max_wait_s": 1.0})
        teach_both(svc, batches=((1, 20.0),))  # only ever alone: a flat line, seen batch 1
        placed = await fill(svc, 10)  # 5 per worker
        assert all(r.worker_id in (1, 2) for r in placed)
        probe = asyncio.create_task(svc.place(call("probe")))
        await asyncio.sleep(0.1)
        assert not probe.done()
        assert [e.reason for e in svc.held._heap] == ["tpot-unseen-batch"]
        # The batch's answers teach the line at 5: room to grow to 10.
        predictor = svc.qos.predictor
        for worker in ("1", "2"):
            for _ in range(3):
                predictor.workers[worker].tpot.update(0.2, 5, 22.0)
        svc._wake_held()
        reply = await asyncio.wait_for(probe, 1.0)
        assert reply.worker_id in (1, 2) and reply.qos["reason"] == "within-slo"
    asyncio.run(go())


def test_a_guess_never_refuses_an_unseen_batch_is_placed_when_its_wait_ends():
    async def go():
        svc = service({"max_wait_s": 0.1})
        teach_both(svc, batches=((1, 20.0),))
        await fill(svc, 10)
        reply = await svc.place(call("probe"))
        assert reply.worker_id in (1, 2), reply
        assert held_count(svc, "placed") == 1
    asyncio.run(go())


def test_a_request_that_would_wait_longer_than_its_slack_is_refused_at_once():
    async def go():
        svc = service()
        teach_both(svc)
        await fill(svc, 14)
        svc.qos.predictor.service_ms = 60_000.0  # answers end once a minute
        t0 = time.monotonic()
        reply = await svc.place(call("probe"))
        assert reply.reason == "rejected-tpot-slo-risk" and time.monotonic() - t0 < 0.1
        assert len(svc.held) == 0
    asyncio.run(go())


def test_shadow_mode_and_a_disabled_hold_never_hold():
    async def go(svc):
        teach_both(svc)
        await fill(svc, 14)
        t0 = time.monotonic()
        reply = await svc.place(call("probe"))
        return reply, time.monotonic() - t0
    reply, took = asyncio.run(go(service({"enabled": False})))
    assert reply.reason == "rejected-tpot-slo-risk" and took < 0.1
    reply, took = asyncio.run(go(service(mode="shadow")))
    assert reply.worker_id is not None and reply.qos["would_reject"] and took < 0.1


def test_held_requests_leave_in_deadline_order():
    async def go():
        svc = service()
        teach_both(svc)
        placed = await fill(svc, 14)
        first = asyncio.create_task(svc.place(call("first")))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(svc.place(call("second")))
        await asyncio.sleep(0.05)
        assert len(svc.held) == 2
        release(svc, "r0", placed[0].worker_id)
        done, _ = await asyncio.wait({first, second}, timeout=1.0,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done == {first}
        second.cancel()
        await asyncio.sleep(0.1)
        assert len(svc.held) == 0 and held_count(svc, "cancelled") == 1
    asyncio.run(go())


def test_admission_holds_an_unseen_batch_only_when_holding():
    predictor = LatencyPredictor()
    now = 0.0
    for i in range(3):  # taught alone only
        predictor.place(f"a{i}", "1", predictor.predict("1", 10, now), now,
                        class_name="default")
        predictor.first_token(f"a{i}", now + 0.05)
        predictor.finish(f"a{i}", now + 0.25, ok=True, ttft_s=0.05, duration_s=0.25,
                         output_tokens=11)
        now += 1.0
    for i in range(5):
        predictor.place(f"b{i}", "1", predictor.predict("1", 10, now), now,
                        class_name="default")
    est = predictor.predict("1", 10, now)
    assert est.tpot_batch == 6 and est.tpot_seen_batch == 1
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=16)
    assert admit(req, est, config).reason == "within-slo"
    held = admit(req, est, config, holding=True)
    assert not held.admit and held.reason == "tpot-unseen-batch"
    shadow = config.model_copy(update={"mode": "shadow"})
    assert admit(req, est, shadow, holding=True).admit


def test_a_long_answer_joins_only_a_batch_that_leaves_the_tpot_headroom_free():
    """Both workers hold 5 one-token requests (``fakes.TAUGHT``: a sixth predicts 45 ms,
    under the 50 ms target).  A one-token probe is placed; a 400-token one outlasts its
    estimate's view (the recent prefill window) for nearly all its life, so its batch
    must leave ``tpot_headroom`` (0.2) of the target free, ~40 ms: it is held for its
    TPOT and refused when its wait ends, at that limit.  With no headroom it is placed."""
    async def go(svc, max_tokens):
        teach_both(svc)
        placed = await fill(svc, 10)
        assert all(r.worker_id in (1, 2) for r in placed)
        probe = RouteCall(request_id="probe", token_ids=list(range(10)),
                          max_tokens=max_tokens)
        return svc, await svc.place(probe)
    hold = {"tpot_headroom": 0.2, "max_wait_s": 0.1}
    svc, reply = asyncio.run(go(service(hold), 400))
    assert reply.worker_id is None and reply.reason == "rejected-tpot-slo-risk", reply
    assert reply.qos["est_tpot_ms"] == pytest.approx(45.0, rel=0.05)
    assert 40.0 < reply.qos["tpot_limit_ms"] < 41.0
    assert held_count(svc, "refused") == 1
    assert asyncio.run(go(service(hold), 1))[1].worker_id in (1, 2)
    no_headroom = {"tpot_headroom": 0, "max_wait_s": 0.1}
    assert asyncio.run(go(service(no_headroom), 400))[1].worker_id in (1, 2)


def test_the_tpot_headroom_scales_with_what_outlasts_the_estimate_and_only_when_holding():
    predictor, now = taught_predictor()
    short = predictor.predict("1", 10, now, output_tokens=11)
    long = predictor.predict("1", 10, now, output_tokens=2000)
    assert short.tpot_outlast_share == 0.0  # ends within the recent window
    assert 0.95 < long.tpot_outlast_share < 1.0
    assert predictor.predict("1", 10, now).tpot_outlast_share == 0.0  # length unknown
    est = long.model_copy(update={"est_tpot_ms": 45.0, "tpot_spread_ms": 0.0,
                                  "unloaded_tpot_ms": 20.0, "running_slack_ms": None,
                                  "tpot_outlast_share": 1.0})
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=2000)
    held = admit(req, est, config, holding=True)
    assert not held.admit and held.reason == "tpot-slo-risk"
    assert held.tpot_limit_ms == pytest.approx(40.0)
    half = est.model_copy(update={"tpot_outlast_share": 0.5})
    assert admit(req, half, config, holding=True).tpot_limit_ms == pytest.approx(45.0)
    assert admit(req, est, config).reason == "within-slo"  # not holding: the target
    off = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0,
                                    "hold": {"tpot_headroom": 0}})
    assert admit(req, est, off, holding=True).reason == "within-slo"
    disabled = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0,
                                         "hold": {"enabled": False}})
    assert admit(req, est, disabled, holding=True).admit
    own = est.model_copy(update={"unloaded_tpot_ms": 46.0})  # its own context: 46 ms
    verdict = admit(req, own, config, holding=True)
    assert verdict.admit and verdict.tpot_limit_ms == pytest.approx(46.0)
    with pytest.raises(ValueError, match="tpot_headroom"):
        QosConfig.model_validate({"hold": {"tpot_headroom": 1.0}})


def test_hold_config_validates_and_bounds_growth():
    assert HoldConfig().unseen(6, 1) and not HoldConfig().unseen(5, 1)
    assert not HoldConfig().unseen(16, 8) and HoldConfig().unseen(17, 8)
    with pytest.raises(ValueError, match="max_wait_s"):
        QosConfig.model_validate({"hold": {"max_wait_s": 60}})


def test_time_already_spent_in_the_frontend_counts_in_the_ttft_prediction():
    async def go():
        svc = service()
        teach_both(svc)
        fresh = await svc.place(call("fresh"))
        assert fresh.worker_id is not None and fresh.qos["est_ttft_ms"] < 100
        late = call("late").model_copy(update={"waited_ms": 1990.0})
        reply = await svc.place(late)
        assert reply.reason == "rejected-ttft-slo-risk", reply
        assert reply.qos["est_ttft_ms"] > 1990.0
    asyncio.run(go())


def taught_predictor(fixed_s: float = 0.05, per_token_s: float = 1e-4,
                     predictor: LatencyPredictor | None = None,
                     now: float = 0.0) -> tuple[LatencyPredictor, float]:
    """A predictor (``predictor``, else a new one) whose worker "1" has learned TTFT 50 ms
    + 0.1 ms a token (or ``fixed_s`` + ``per_token_s``) and TPOT 20 ms from six finished
    requests from ``now`` on, and the time after them."""
    predictor = predictor or LatencyPredictor()
    for i, tokens in enumerate((1000, 3000) * 3):
        ttft = fixed_s + tokens * per_token_s
        predictor.place(f"a{i}", "1", predictor.predict("1", tokens, now), now,
                        class_name="default")
        predictor.first_token(f"a{i}", now + ttft)
        predictor.finish(f"a{i}", now + ttft + 0.2, ok=True, ttft_s=ttft,
                         duration_s=ttft + 0.2, output_tokens=11)
        now += 1.0
    return predictor, now


def test_a_prompt_whose_prefill_would_push_a_running_answer_over_budget_is_held():
    predictor, now = taught_predictor()
    assert predictor.running_slack_ms("1", now) is None  # nothing decoding
    # A 11-token answer with a 50 ms budget: 500 ms to spend, decoding at ~20 ms a token.
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now + 0.06)
    slack = predictor.running_slack_ms("1", now + 0.06)
    assert 200 < slack < 350  # 500 - 10 x (20 ms, slowed by the prompt it prefilled)
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=16)
    # ~100 ms of prefill fits; ~500 ms would make the answer miss
    short = predictor.predict("1", 1000, now + 0.06, running_slack=True)
    assert admit(req, short, config, holding=True).admit
    long = predictor.predict("1", 5000, now + 0.06, running_slack=True)
    held = admit(req, long, config, holding=True)
    assert not held.admit and held.reason == "running-tpot-risk"
    assert admit(req, long, config).admit  # only ever a reason to hold
    predictor.finish("r", now + 0.3, ok=True, ttft_s=0.06, duration_s=0.3, output_tokens=11)
    assert predictor.running_slack_ms("1", now + 0.3) is None


def test_a_held_request_whose_judgement_fails_fails_alone():
    from splitserve.components.router.hold_queue import HELD, HoldQueue

    async def go():
        q = HoldQueue()
        bad = q.push("bad", 0.0, deadline=1.0, expires=5.0, reason="tpot-slo-risk")
        good = q.push("good", 0.0, deadline=2.0, expires=5.0, reason="tpot-slo-risk")
        ended = []

        def judge(entry, now, final):
            if entry.call == "bad":
                raise RuntimeError("boom")
            return "placed" if entry.call == "good" else HELD

        assert q.pump(0.1, judge, lambda e, outcome, now: ended.append(outcome)) == 2
        with pytest.raises(RuntimeError, match="boom"):
            await bad.future
        assert await good.future == "placed" and ended == ["failed", "answered"]
    asyncio.run(go())


def test_prefill_already_queued_counts_against_a_running_answers_budget():
    """Prompts admitted one after another each fit a running answer's budget alone; the
    ones still queued ahead spend it first, so a next one is held once together they
    would push the answer over, and an answer the queue already overruns is lost
    anyway and holds nothing."""
    predictor, now = taught_predictor()
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now + 0.06)
    now += 0.06
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=16)
    alone = predictor.running_slack_ms("1", now)
    assert 200 < alone < 350
    prompt = predictor.predict("1", 1500, now, running_slack=True)  # ~150 ms of prefill
    assert admit(req, prompt, config, holding=True).admit
    predictor.place("q", "1", prompt, now, class_name="default")  # queued, no token yet
    after = predictor.predict("1", 1500, now, running_slack=True)
    assert after.running_slack_ms < alone - 100  # the queued prompt's ~150 ms are spent
    held = admit(req, after, config, holding=True)
    assert not held.admit and held.reason == "running-tpot-risk"
    predictor.place("big", "1", predictor.predict("1", 4000, now), now, class_name="default")
    lost = predictor.predict("1", 1500, now, running_slack=True)
    assert lost.running_slack_ms is None  # ~550 ms queued: the answer misses regardless
    assert admit(req, lost, config, holding=True).admit


def test_an_answer_still_waiting_for_its_first_token_is_protected_from_prompts_behind_it():
    """The prompts placed after a request are prefilled while it decodes: its budget is
    spent by them, so a burst cannot pile onto a short answer that has not started."""
    predictor, now = taught_predictor()
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=16)
    # 10 tokens after the first with 50 ms each: ~300 ms to spare at ~20 ms a token
    predictor.place("w", "1", predictor.predict("1", 200, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    budget = predictor.running_slack_ms("1", now, 0.1)
    assert 200 < budget < 350
    first = predictor.predict("1", 1500, now, running_slack=True)  # ~150 ms of prefill
    assert admit(req, first, config, holding=True).admit
    predictor.place("b", "1", first, now, class_name="default")
    second = predictor.predict("1", 1500, now, running_slack=True)
    assert second.running_slack_ms < budget - 100  # "b" runs during "w"'s answer
    held = admit(req, second, config, holding=True)
    assert not held.admit and held.reason == "running-tpot-risk"
    predictor.first_token("w", now + 0.1)  # decoding now: still protected, "b" ahead
    later = predictor.predict("1", 1500, now + 0.1, running_slack=True)
    assert not admit(req, later, config, holding=True).admit


def assert_held_for_running(estimate) -> None:
    """A prompt with ``estimate`` is held for the answers running on its worker."""
    config = QosConfig.model_validate({"classes": [CLASS], "low_priority_threshold_ms": 0})
    req = AdmissionRequest(class_name="default", prompt_tokens=10, max_tokens=16)
    held = admit(req, estimate, config, holding=True)
    assert not held.admit and held.reason == "running-tpot-risk"
    assert admit(req, estimate, config).admit  # only ever a reason to hold


def test_a_stalled_answer_has_not_decoded_while_prompts_were_prefilled():
    """An answer's progress is the time since its first token that its worker had no
    prompt to prefill: 200 ms of stall right after its first token leave all ten of its
    tokens to decode (200 ms at ~20 ms) in the 300 ms its budget has left, so only
    ~100 ms of new prefill fit, however the recent busy share reads."""
    predictor, now = taught_predictor()
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now)
    predictor.place("q", "1", predictor.predict("1", 1500, now), now, class_name="default")
    predictor.first_token("q", now + 0.2)  # prefilled for 200 ms: "r" stalled meanwhile
    slack = predictor.running_slack_ms("1", now + 0.2, 0.1)
    assert 60 < slack < 140
    assert_held_for_running(predictor.predict("1", 1500, now + 0.2, running_slack=True))


def test_an_answer_slower_than_its_line_is_protected_until_its_release():
    """The line said ten tokens take ~200 ms; at 350 ms the answer is still running (no
    stall): it has at least one token left and ~130 ms of its budget, so a prompt of
    ~200 ms waits for it instead of being sent on as if it had ended."""
    predictor, now = taught_predictor()
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now)
    slack = predictor.running_slack_ms("1", now + 0.35, 0.1)
    assert slack is not None and 100 < slack < 140
    assert_held_for_running(predictor.predict("1", 2000, now + 0.35, running_slack=True))


def test_headroom_keeps_back_a_share_of_every_protected_budget():
    predictor, now = taught_predictor()
    predictor.place("w", "1", predictor.predict("1", 200, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    full = predictor.running_slack_ms("1", now, 0.1)
    kept = predictor.running_slack_ms("1", now, 0.1, headroom=0.2)
    assert kept == pytest.approx(full - 0.2 * 50.0 * 10)
    # ... and the policy's default reaches the prediction admission judges
    assert HoldConfig().running_headroom == 0.2
    with pytest.raises(ValueError, match="running_headroom"):
        HoldConfig(running_headroom=1.0)


def test_a_prompts_stall_is_charged_at_the_fits_rate_through_the_origin_when_higher():
    """TTFTs of 410 and 430 ms at 1,000 and 3,000 tokens fit a line of 400 ms plus
    0.01 ms a token; a prompt's prefill is not judged to stall the running answers by
    0.01 ms a token when the samples say up to ~0.17."""
    predictor, now = taught_predictor(fixed_s=0.4, per_token_s=1e-5)
    fixed, slope, _ = predictor.ttft_line("1", now)
    assert slope == pytest.approx(0.01, rel=0.05) and fixed == pytest.approx(400, rel=0.05)
    assert 0.15 < predictor.stall_per_token("1", now) < 0.19
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now)
    est = predictor.predict("1", 2500, now, running_slack=True)  # ~425 ms, not 25
    assert est.stall_per_token_ms > 0.15 and est.running_slack_ms > 25
    assert_held_for_running(est)


def test_the_policys_headroom_reaches_the_slack_admission_judges():
    slacks = []
    for headroom in (0.0, 0.5):
        svc = service({"running_headroom": headroom})
        teach_both(svc)
        now = time.monotonic()
        est = svc.qos._estimate(call("w"), 1, 0, now, 0.0, "default")
        svc.qos.predictor.place("w", "1", est, now, class_name="default", max_tokens=11,
                                tpot_budget_ms=50.0)
        slacks.append(svc.qos._estimate(call("p"), 1, 0, now, 0.0, "default",
                                        holding=True).running_slack_ms)
    assert slacks[0] - slacks[1] == pytest.approx(0.5 * 50.0 * 10)



def test_a_long_answer_is_judged_at_the_long_run_prefill_share():
    """Right after a prompt kept worker "1" busy for a second, its recent prefill share
    reads ~0.9 and its long-run share ~0.2.  A ten-token answer decodes within the
    recent stretch and is judged at it; a 400-token answer outlasts it by far and is
    judged near the long-run share (admitted where the short one is refused for its
    TPOT); and a long-run share above the recent one (the burst is over) never raises
    a prediction."""
    predictor, now = taught_predictor()
    predictor.place("q", "1", predictor.predict("1", 100, now), now, class_name="default")
    now += 1.0
    base, slope, _ = predictor.tpot_line("1", now)
    w = predictor.workers["1"]
    assert w.busy > 0.8 and 0.05 < w.busy_long < 0.4
    step = base + slope * (w.running + 1)
    short = predictor.predict("1", 100, now, output_tokens=11)
    long = predictor.predict("1", 100, now, output_tokens=400)
    unknown = predictor.predict("1", 100, now)
    assert short.est_tpot_ms == pytest.approx(unknown.est_tpot_ms)  # max_tokens unknown
    assert short.est_tpot_ms == pytest.approx(step / (1 - min(0.9, w.busy)))
    assert step / (1 - w.busy_long) < long.est_tpot_ms < 0.5 * short.est_tpot_ms
    config = QosConfig.model_validate({"classes": [{**CLASS, "tpot_ms": 60}],
                                       "low_priority_threshold_ms": 0})
    verdict = admit(AdmissionRequest(class_name="default", prompt_tokens=100,
                                     max_tokens=11), short, config)
    assert not verdict.admit and verdict.reason == "tpot-slo-risk"
    assert admit(AdmissionRequest(class_name="default", prompt_tokens=100, max_tokens=400),
                 long, config).admit
    predictor.first_token("q", now)  # the prompt is done: the recent share decays first
    later = predictor.predict("1", 100, now + 2.0, output_tokens=400)
    assert w.busy < w.busy_long
    assert later.est_tpot_ms == pytest.approx(
        predictor.predict("1", 100, now + 2.0, output_tokens=11).est_tpot_ms)


def test_what_a_prompt_stalls_is_measured_beside_what_is_charged():
    """An 11-token answer decodes at 20 ms a token alone; with two prompts of 2,200
    tokens prefilled beside it, it took 400 ms for its ten tokens: 200 ms of stall,
    about 0.09 ms per prompt token, measured from the answer and exported beside the
    rate admission charges (calibration only)."""
    svc = service()
    predictor, now = taught_predictor(predictor=svc.qos.predictor,
                                      now=time.monotonic() - 100.0)
    predictor.place("r", "1", predictor.predict("1", 100, now), now, class_name="default",
                    max_tokens=11, tpot_budget_ms=50.0)
    predictor.first_token("r", now + 0.06)
    predictor.place("small", "1", predictor.predict("1", 200, now), now, class_name="default")
    predictor.place("q", "1", predictor.predict("1", 2000, now), now, class_name="default")
    predictor.first_token("small", now + 0.08)
    predictor.first_token("q", now + 0.26)
    assert predictor.measured_stall_per_token("1") is None
    end = now + 0.46
    svc.qos.observe(ReleaseCall(request_id="r", worker_id=1, output_tokens=11,
                                ttft_s=0.06, duration_s=0.46), end)
    assert predictor.measured_stall_per_token("1") == pytest.approx(200 / 2200, rel=0.05)
    assert predictor.measured_stall_per_token() == predictor.measured_stall_per_token("1")
    gauge = {s.labels["kind"]: s.value for m in svc.qos.metrics.stall.collect()
             for s in m.samples if s.labels["worker"] == "1"}
    assert gauge["measured"] == pytest.approx(200 / 2200, rel=0.05)
    assert gauge["charged"] == pytest.approx(predictor.stall_per_token("1", end))
    # an answer with fewer prompt tokens than STALL_SAMPLE_MIN_TOKENS beside it is none
    predictor.place("s", "1", predictor.predict("1", 100, end), end, class_name="default",
                    max_tokens=11)
    predictor.first_token("s", end + 0.05)
    predictor.place("tiny", "1", predictor.predict("1", 100, end), end, class_name="default")
    predictor.first_token("tiny", end + 0.06)
    predictor.finish("s", end + 0.5, ok=True, ttft_s=0.05, duration_s=0.5, output_tokens=11)
    assert predictor.measured_stall_per_token("1") == pytest.approx(200 / 2200, rel=0.05)
