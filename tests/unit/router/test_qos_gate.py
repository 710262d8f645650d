"""The router's QoS gate on fake fleets: a burst the workers absorb is admitted, only
requests predicted to miss TTFT or TPOT are refused (or moved to a worker that meets
them), shadow mode refuses nothing, and every finished request lands in the confusion
table and the calibration histogram."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from splitserve.components.frontend.config import FrontendConfig
from splitserve.contracts.wire import ReleaseCall, RouteCall
from splitserve.components.router.qos import QosConfig
from splitserve.components.router.qos_gate import QosGate, outcome_of
from splitserve.components.router.types import WorkerState

pytestmark = pytest.mark.unit

WORKERS = (1, 2, 3, 4)
TEACHER = 9  # a worker outside the fleet whose requests teach the pool's fits

# The one-line form: the class's SLO and may_reject, nothing else.
ONE_DEFAULT = {"classes": [{"name": "default", "ttft_ms": 2000, "tpot_ms": 50,
                            "may_reject": True}], "low_priority_threshold_ms": 0}


def qos(**fields) -> QosConfig:
    return QosConfig.model_validate({**ONE_DEFAULT, **fields})


def route(rid: str, tokens: int = 1000) -> RouteCall:
    return RouteCall(request_id=rid, token_ids=list(range(tokens)), max_tokens=64)


class Fleet:
    """Drives a gate as the router service does: the policy's pick, the clock, releases."""

    def __init__(self, gate: QosGate) -> None:
        self.gate, self.now = gate, 100.0
        self.workers = tuple(WorkerState(worker_id=w) for w in (*WORKERS, TEACHER))

    def admit(self, rid: str, worker: int | None, tokens: int = 1000, record: bool = True,
              candidates: tuple[int, ...] = WORKERS):
        return self.gate.check(route(rid, tokens), self.workers, {}, self.now, record,
                               chosen=worker, candidates=candidates)

    def finish(self, rid: str, worker: int, ttft_s: float, tpot_ms: float,
               output: int = 11) -> None:
        duration = ttft_s + (output - 1) * tpot_ms / 1000.0
        self.now += duration
        self.gate.observe(ReleaseCall(request_id=rid, worker_id=worker, output_tokens=output,
                                      ttft_s=ttft_s, duration_s=duration), self.now)

    def teach(self, tpot_by_batch: dict[int, float] | None = None) -> None:
        """Requests alone on the teacher: TTFT 50 ms + 0.1 ms per token (single-token
        answers); then batches of 10-token prompts, the probes' size, with the TPOT given
        per batch size (default: 20 ms whatever the batch).  The TPOT line is on the KV
        the batch holds, so a batch of 3 teaches what 30 tokens of context cost."""
        rows = [(10, 0.051, batch, tpot) for batch, tpot in (tpot_by_batch or {1: 20.0})
                .items()] * 3
        rows += [(own, ttft_s, 1, 0.0) for own, ttft_s in
                 [(100, 0.060), (1000, 0.150), (2000, 0.250)]] * 2
        for own, ttft_s, batch, tpot in rows:
            rids = [f"teach-{self.now}-{i}" for i in range(batch)]
            for rid in rids:
                self.gate.check(route(rid, own), self.workers, {}, self.now, True,
                                chosen=TEACHER, candidates=(TEACHER,))
            output = 11 if tpot else 1
            duration = ttft_s + (output - 1) * tpot / 1000.0
            self.now += duration
            for rid in rids:
                self.gate.observe(ReleaseCall(request_id=rid, worker_id=TEACHER,
                                              output_tokens=output, ttft_s=ttft_s,
                                              duration_s=duration), self.now)
            self.now += 10.0


def counts(gate: QosGate, metric: str, *labels: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for m in getattr(gate.metrics, metric).collect():
        for s in m.samples:
            if s.name.endswith("_total"):
                key = tuple(s.labels[k] for k in labels)
                out[key] = out.get(key, 0.0) + s.value  # summed over the other labels
    return out


def test_the_one_line_form_validates_in_the_frontend_section():
    cfg = FrontendConfig.model_validate({"routing": "in_process", "router": {
        "policy": "kv_aware", "block_size": 64, "qos": ONE_DEFAULT}})
    (cls,) = cfg.router_settings().qos.classes
    assert (cls.name, cls.may_reject, cls.may_degrade) == ("default", True, False)


def test_before_learning_everything_is_admitted_for_lack_of_an_estimate():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    verdicts = [fleet.admit(f"r{i}", WORKERS[i % 4]).verdict for i in range(50)]
    assert {(v.admit, v.reason) for v in verdicts} == {(True, "no-estimate")}


def test_a_burst_the_fleet_absorbs_is_admitted():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach()
    # 40 prompts of 1000 tokens at once, 10 per worker: the last waits for 9000 tokens
    # at 0.1 ms each, 0.95 s in all, well inside 2 s.
    admissions = [fleet.admit(f"b{i}", WORKERS[i % 4]) for i in range(40)]
    assert all(a.verdict.admit and a.verdict.reason == "within-slo" for a in admissions)
    assert admissions[-1].estimate.est_ttft_ms == pytest.approx(50 + 10_000 * 0.1)


@pytest.mark.parametrize(("queued", "admitted"), [
    (18, True),   # 18,000 tokens ahead + 1000 own: 1950 ms
    (19, False),  # 20,000 + 50: 2050 ms
])
def test_a_request_predicted_to_miss_ttft_is_refused(queued, admitted):
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach()
    for i in range(queued):  # one worker's queue; the others busy as deep
        for w in WORKERS:
            fleet.admit(f"q{w}-{i}", w, record=True)
    adm = fleet.admit("probe", 1, record=False)
    assert (adm.verdict.admit, adm.verdict.reason) == (
        (True, "within-slo") if admitted else (False, "ttft-slo-risk"))


def test_a_request_predicted_to_miss_tpot_is_refused():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach({1: 20.0, 3: 30.0})  # TPOT = 15 ms + 5 ms per running request
    for i in range(7):  # batches of 7 on every worker: 50 ms, at the target
        for w in WORKERS:
            assert fleet.admit(f"r{w}-{i}", w, tokens=10).verdict.admit
    adm = fleet.admit("probe", 1, tokens=10, record=False)  # would make 8: 55 ms
    assert (adm.verdict.admit, adm.verdict.reason) == (False, "tpot-slo-risk")
    assert adm.estimate.tpot_batch == 8
    assert adm.verdict.est_tpot_ms == pytest.approx(55.0, rel=0.05)
    assert adm.verdict.retry_after_s == 1


def test_a_worker_that_would_miss_hands_the_request_to_one_that_meets_the_targets():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach({1: 20.0, 3: 30.0})
    for i in range(7):
        fleet.admit(f"r{i}", 1, tokens=10)
    adm = fleet.admit("moved", 1, tokens=10)
    assert adm.verdict.admit and adm.rerouted and adm.worker_id != 1


@pytest.mark.parametrize("placement", ["slo-prefix", "slo", "policy"])
def test_a_pick_with_prompts_queued_ahead_moves_to_the_worker_that_serves_it_sooner(
        placement):
    fleet = Fleet(QosGate(qos(placement=placement), CollectorRegistry()))
    fleet.teach()
    fleet.admit("long", 1, tokens=6000)  # worker 1: 6000 prompt tokens ahead
    # The policy's pick (say, for a small prefix hit) would meet the target (50 + 7000 x
    # 0.1 = 750 ms of 2000) but an idle worker answers in 150 ms.
    adm = fleet.admit("next", 1, tokens=1000, record=False)
    assert adm.verdict.admit and adm.verdict.reason == "within-slo"
    if placement == "policy":
        assert (adm.worker_id, adm.rerouted) == (1, False)
    else:
        assert adm.worker_id != 1 and adm.rerouted and adm.why == "qos-placed"
        assert adm.estimate.est_ttft_ms == pytest.approx(150.0, rel=0.01)


def test_slo_placement_counts_the_prefix_each_worker_holds():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach()
    fleet.admit("long", 1, tokens=6000)
    # Worker 3 holds 900 of the 1000 prompt tokens: only 100 to prefill there.
    adm = fleet.gate.check(route("next", 1000), fleet.workers, {3: 900}, fleet.now, False,
                           chosen=1, candidates=WORKERS)
    assert adm.worker_id == 3 and adm.estimate.request_tokens == 100
    # And the policy's pick stands when it is already the best place.
    stay = fleet.gate.check(route("again", 1000), fleet.workers, {3: 900}, fleet.now,
                            False, chosen=3, candidates=WORKERS)
    assert (stay.worker_id, stay.rerouted) == (3, False)


def test_slo_prefix_placement_never_trades_the_prefix_holder_for_a_smaller_queue():
    """Worker 1 holds 500 of the prompt's tokens and has a prompt queued ahead; the idle
    workers hold none.  `slo` moves the request to an idle one (it prefills the 500
    again there); `slo-prefix` only looks among workers holding as much (worker 2) and
    moves it there, and with no such worker it keeps the pick."""
    for placement, cached, expect in (("slo", {1: 500}, {2, 3, 4}),
                                      ("slo-prefix", {1: 500}, {1}),
                                      ("slo-prefix", {1: 500, 2: 500}, {2}),
                                      ("slo-prefix", {1: 500, 2: 600}, {2})):
        fleet = Fleet(QosGate(qos(placement=placement), CollectorRegistry()))
        fleet.teach()
        fleet.admit("long", 1, tokens=6000)
        adm = fleet.gate.check(route("next", 1000), fleet.workers, cached, fleet.now,
                               False, chosen=1, candidates=WORKERS)
        assert adm.verdict.admit and adm.worker_id in expect, (placement, cached)
        assert adm.rerouted == (adm.worker_id != 1)
    # With nothing cached on the pick every candidate may take it, as with `slo`.
    fleet = Fleet(QosGate(qos(placement="slo-prefix"), CollectorRegistry()))
    fleet.teach()
    fleet.admit("long", 1, tokens=6000)
    assert fleet.admit("next", 1, record=False).worker_id != 1


def test_slo_prefix_placement_looks_at_every_prefix_holder_on_a_large_fleet():
    """On a fleet of more than five only a few alternatives are judged (the least loaded
    and those holding the most of the prompt); with `slo-prefix` they are chosen among
    the workers holding as much as the pick.  Worker 8, idle and holding 600 tokens, is
    neither among the four least loaded of the whole fleet (idle 4 to 7 hold nothing) nor
    among the two holding the most (2 and 3, 700 each, both with a prompt queued)."""
    fleet = Fleet(QosGate(qos(placement="slo-prefix"), CollectorRegistry()))
    fleet.workers = tuple(WorkerState(worker_id=w) for w in (*range(1, 9), TEACHER))
    fleet.teach()
    everyone = tuple(range(1, 9))
    for wid in (2, 3, 1):
        assert fleet.admit(f"ahead-{wid}", wid, tokens=6000,
                           candidates=everyone).worker_id == wid
    adm = fleet.gate.check(route("next", 1000), fleet.workers,
                           {1: 500, 2: 700, 3: 700, 8: 600}, fleet.now, False, chosen=1,
                           candidates=everyone)
    assert adm.verdict.admit and (adm.worker_id, adm.rerouted) == (8, True)


def test_a_class_that_is_always_admitted_keeps_the_policys_pick():
    fleet = Fleet(QosGate(qos(classes=[{"name": "default", "ttft_ms": 2000, "tpot_ms": 50,
                                         "may_reject": False}]), CollectorRegistry()))
    fleet.teach()
    fleet.admit("long", 1, tokens=6000)
    adm = fleet.admit("next", 1, tokens=1000, record=False)
    assert (adm.worker_id, adm.rerouted, adm.verdict.reason) == (1, False, "always-admit")


def test_slo_placement_moves_nothing_in_warm_up_or_shadow_mode():
    cold = Fleet(QosGate(qos(), CollectorRegistry()))
    cold.admit("long", 1, tokens=6000)
    assert cold.admit("next", 1, record=False).worker_id == 1
    shadow = Fleet(QosGate(qos(mode="shadow"), CollectorRegistry()))
    shadow.teach()
    shadow.admit("long", 1, tokens=6000)
    adm = shadow.admit("next", 1, record=False)
    assert (adm.worker_id, adm.rerouted) == (1, False)


def test_without_a_pick_the_admitted_worker_predicted_fastest_is_judged():
    fleet = Fleet(QosGate(qos(), CollectorRegistry()))
    fleet.teach()
    for w in (1, 2, 4):
        fleet.admit(f"busy{w}", w, tokens=4000)
    adm = fleet.admit("free", None, record=False)
    assert adm.worker_id == 3 and not adm.rerouted


def test_shadow_mode_never_refuses_but_counts_what_it_would_refuse():
    gate = QosGate(qos(mode="shadow"), CollectorRegistry())
    fleet = Fleet(gate)
    fleet.teach({1: 20.0, 3: 30.0})
    verdicts = [fleet.admit(f"r{i}", 1, tokens=2000).verdict for i in range(30)]
    assert all(v.admit for v in verdicts)
    would = [v for v in verdicts if v.would_reject]
    assert would and {v.reason for v in would} <= {"ttft-slo-risk", "tpot-slo-risk"}
    assert all(v.degrade == () for v in verdicts)
    by = counts(gate, "verdicts", "outcome", "reason")
    assert sum(n for (o, _), n in by.items() if o == "shadow-rejected") == len(would)
    assert not any(o == "rejected" for o, _ in by)
    assert not any(a.rerouted for a in [fleet.admit("x", 1, tokens=2000, record=False)])


def cal(would: bool, ttft_ms: float, tpot_ms: float | None, waited_ms: float = 0.0):
    from splitserve.components.router.qos.predictor import Calibration
    return Calibration("default", "1", would, True, True, 100.0, ttft_ms, 20.0, tpot_ms, 1.0,
                       waited_ms)


@pytest.mark.parametrize(("calibration", "cell"), [
    (cal(False, 1500, 40), "admitted-met"),
    (cal(False, 2000, 50), "admitted-met"),  # at the targets exactly
    (cal(False, 2001, 40), "admitted-missed"),
    (cal(False, 1500, 51), "admitted-missed"),
    (cal(False, 1500, None), "admitted-met"),  # one output token: TTFT alone decides
    (cal(True, 1500, 40), "would-refuse-met"),
    (cal(True, 3000, 40), "would-refuse-missed"),
    # The client's TTFT: the wait before the placement counts.
    (cal(False, 1500, 40, waited_ms=500), "admitted-met"),
    (cal(False, 1500, 40, waited_ms=501), "admitted-missed"),
])
def test_confusion_table_outcomes(calibration, cell):
    assert outcome_of(calibration, qos()) == cell


def test_a_request_that_waited_before_its_placement_is_judged_on_the_clients_ttft():
    """A request held (or slow in the frontend) for 1.8 s before it was placed, predicted
    ~150 ms from there, whose first token came 250 ms after the placement, missed a 2 s
    TTFT target: the
    confusion table says so, while the worker's fit and the prediction error compare
    the placement-relative times (the prediction kept for them leaves the wait out)."""
    gate = QosGate(qos(), CollectorRegistry())
    fleet = Fleet(gate)
    fleet.teach()
    adm = gate.check(route("late", 1000), fleet.workers, {}, fleet.now, True, chosen=1,
                     candidates=WORKERS, waited_ms=1800.0)
    assert adm.verdict.admit  # 1.8 s + ~150 ms predicted: within 2 s
    assert adm.estimate.waited_ms == 1800.0
    assert adm.estimate.est_ttft_ms < 500  # the kept prediction is from the placement on
    taught = counts(gate, "confusion", "outcome")[("admitted-met",)]
    fleet.finish("late", 1, ttft_s=0.25, tpot_ms=20.0)
    assert counts(gate, "confusion", "outcome") == {("admitted-met",): taught,
                                                     ("admitted-missed",): 1}
    fleet.admit("prompt", 2)  # placed at once, the same 250 ms: met
    fleet.finish("prompt", 2, ttft_s=0.25, tpot_ms=20.0)
    assert counts(gate, "confusion", "outcome")[("admitted-met",)] == taught + 1


def test_releases_fill_the_confusion_table_and_the_calibration_histogram():
    gate = QosGate(qos(), CollectorRegistry())
    fleet = Fleet(gate)
    fleet.teach()
    adm = fleet.admit("met", 1)
    predicted = adm.estimate.est_ttft_ms  # 50 + 1000 x 0.1 = 150 ms
    fleet.finish("met", 1, ttft_s=0.28, tpot_ms=20.0)  # log2(280 / 150) = 0.9
    fleet.admit("slow", 2)
    fleet.finish("slow", 2, ttft_s=2.5, tpot_ms=20.0)
    queued = 0
    while fleet.admit(f"q{queued}", 3, candidates=(3,)).verdict.admit:  # until refused
        queued += 1
    assert 5 < queued < 40
    table = counts(gate, "confusion", "outcome")
    assert table == {("admitted-met",): 10, ("admitted-missed",): 1, ("refused",): 1}
    # Each cell names the worker it was predicted for: the slow one was worker 2.
    assert counts(gate, "confusion", "outcome", "worker")[("admitted-missed", "2")] == 1
    hist: dict[tuple[str, str], float] = {}
    for m in gate.metrics.error.collect():
        for s in m.samples:
            if s.name.endswith(("_bucket", "_count")):
                key = (s.labels["kind"], s.labels.get("le", "count"))
                hist[key] = hist.get(key, 0.0) + s.value
    assert {s.labels["worker"] for m in gate.metrics.error.collect() for s in m.samples} \
        >= {"1", "2"}
    # The teacher's requests were predicted at warm-up (not counted) or exactly; 
    # took 1.87 times its prediction (log2 ratio 0.9), "slow" far longer.
    assert predicted == pytest.approx(150.0)
    assert hist[("ttft", "count")] >= 2 and hist[("tpot", "count")] >= 2
    assert hist[("ttft", "1.0")] - hist[("ttft", "0.5")] == 1
    assert hist[("ttft", "+Inf")] - hist[("ttft", "3.0")] == 1
