"""The router's QoS gate engages on a fleet that is overloaded from its first request."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from splitserve.components.protocol import ReleaseCall, RouteCall
from splitserve.components.qos import QosConfig
from splitserve.components.router.qos_gate import BOOTSTRAP_SAMPLES, QosGate

pytestmark = pytest.mark.unit

WORKERS = 4


def rejecting_config() -> QosConfig:
    return QosConfig.model_validate({
        "classes": [{"name": "default", "ttft_ms": 2000, "tpot_ms": 50, "may_reject": True,
                     "may_degrade": False}],
        "default_class": "default", "low_priority_threshold_ms": 0})


def route(rid: str, tokens: int = 400) -> RouteCall:
    return RouteCall(request_id=rid, token_ids=list(range(tokens)), max_tokens=32)


def release(rid: str, ttft_s: float, duration_s: float, tokens: int = 400) -> ReleaseCall:
    return ReleaseCall(request_id=rid, worker_id=1, prompt_tokens=tokens, output_tokens=32,
                       ttft_s=ttft_s, duration_s=duration_s)


class Fleet:
    """Drives a gate the way the router service does: in-flight count, clock."""

    def __init__(self, gate: QosGate) -> None:
        self.gate, self.now, self.inflight = gate, 100.0, 0

    def admit(self, rid: str):
        verdict = self.gate.check(route(rid), (), 0, self.now, record=True,
                                  inflight=self.inflight)
        if verdict.admit:
            self.inflight += 1
        return verdict

    def finish(self, rid: str, ttft_s: float, duration_s: float) -> None:
        self.inflight -= 1
        self.gate.observe(release(rid, ttft_s, duration_s), self.now, self.inflight, WORKERS)


def reasons(gate: QosGate) -> dict[tuple[str, str], float]:
    out = {}
    for metric in gate.metrics.verdicts.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[(s.labels["outcome"], s.labels["reason"])] = s.value
    return out


def test_requests_admitted_into_a_free_fleet_teach_the_rates_although_load_followed():
    fleet = Fleet(QosGate(rejecting_config(), CollectorRegistry()))
    for i in range(40):  # a burst: 40 admitted before anything finishes
        assert fleet.admit(f"r{i}").reason == "no-estimate"
    fleet.now += 1.0
    fleet.finish("r0", ttft_s=0.2, duration_s=1.0)  # admitted at in-flight 0: unloaded
    assert fleet.gate.estimator.rate("prefill", "decode").source != "warmup"
    assert fleet.gate.service_ms == pytest.approx(1000.0)


def test_bootstrap_from_loaded_samples_when_no_request_ever_ran_unloaded():
    gate = QosGate(rejecting_config(), CollectorRegistry())
    fleet = Fleet(gate)
    fleet.inflight = 50  # another router's burst: every request is admitted under load
    for i in range(BOOTSTRAP_SAMPLES - 1):
        fleet.admit(f"r{i}")
        fleet.now += 0.1
        fleet.finish(f"r{i}", ttft_s=3.0 + i, duration_s=5.0 + i)
    assert gate.estimator.rate("prefill", "decode").source == "warmup"
    fleet.admit("last")
    fleet.now += 0.1
    fleet.finish("last", ttft_s=2.0, duration_s=4.0)
    rate = gate.estimator.rate("prefill", "decode")
    assert rate.source != "warmup"
    assert rate.value == pytest.approx(2000.0 / 400)  # the fastest sample per token
    uses = {s.labels["use"]: s.value for m in gate.metrics.samples.collect()
            for s in m.samples if s.name.endswith("_total")}
    assert uses == {"loaded-skipped": BOOTSTRAP_SAMPLES, "bootstrap": 1}


def test_sustained_overload_rejects_with_a_reason_other_than_no_estimate():
    gate = QosGate(rejecting_config(), CollectorRegistry())
    fleet = Fleet(gate)
    # Unloaded phase: 4 requests, one per worker, 0.1 s TTFT, 1 s each.
    for i in range(WORKERS):
        fleet.admit(f"warm{i}")
    fleet.now += 1.0
    for i in range(WORKERS):
        fleet.finish(f"warm{i}", ttft_s=0.1, duration_s=1.0)
    # Overload: 4 completions per second while 10 requests arrive per second.
    admitted: list[str] = []
    rejected = 0
    for step in range(200):
        fleet.now += 0.1
        verdict = fleet.admit(f"o{step}")
        if verdict.admit:
            admitted.append(f"o{step}")
        else:
            rejected += 1
            assert verdict.retry_after_s is not None
        for _ in range(2 if step % 5 == 4 else 0):
            if admitted:
                fleet.finish(admitted.pop(0), ttft_s=1.5, duration_s=2.5)
    counts = reasons(gate)
    assert counts.get(("rejected", "ttft-slo-risk"), 0) == rejected
    assert rejected > 50
    assert counts.get(("admitted", "no-estimate"), 0) <= WORKERS
    # The backlog stays bounded: what is admitted is what the fleet drains.
    assert fleet.inflight < 20


def test_queue_wait_uses_the_current_request_mix_not_the_first_unloaded_requests():
    gate = QosGate(rejecting_config(), CollectorRegistry())
    fleet = Fleet(gate)
    # The only unloaded requests: long answers (150 tokens in 1.5 s).
    for i in range(WORKERS):
        fleet.admit(f"long{i}")
    fleet.now += 1.5
    for i in range(WORKERS):
        fleet.inflight -= 1
        gate.observe(ReleaseCall(request_id=f"long{i}", worker_id=1, prompt_tokens=400,
                                 output_tokens=150, ttft_s=0.1, duration_s=1.5),
                     fleet.now, fleet.inflight, WORKERS)
    # Then overload with short answers: 20 completions of 48 tokens in 5 s, 20 in flight.
    fleet.inflight = 40
    for i in range(20):
        fleet.now += 0.25
        fleet.inflight -= 1
        gate.observe(ReleaseCall(request_id=f"s{i}", worker_id=1, prompt_tokens=400,
                                 output_tokens=48, ttft_s=2.0, duration_s=2.5),
                     fleet.now, fleet.inflight, WORKERS)
    verdict = gate.check(route("next"), (), 0, fleet.now, record=False, inflight=20)
    # Little: 24 completions in the last 5 s, so (20 + 1) / 4.8 = 4.4 s in system; a
    # short request's unloaded duration is ~0.1 + 48 x 9.4 ms = 0.56 s, so ~3.8 s of it
    # is waiting (3.9 s with its own prefill and first step).  Subtracting the long
    # answers' 1.5 s instead would say 2.9 s and 3.0 s.
    assert verdict.est_ttft_ms > 3600
    assert not verdict.admit and verdict.reason == "ttft-slo-risk"
