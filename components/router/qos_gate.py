"""QoS admission in the router process: class resolution, per-worker prediction, verdict,
and the calibration of every prediction against what the frontend measured.

Glue between the pure QoS core (`components/router/qos/`) and what the router observes: the
worker its policy picked (and the other candidates), each worker's prefix hit, its own
placements, and every finished request's timings (release calls), which teach the
per-worker TTFT and TPOT fits (`qos.predictor`).  The same gate runs in the Router
process and in process in the frontend.

Per request: predict on the worker the routing policy chose.  When admission is on for
the request's class and its rules ran (verdict ``within-slo``), with ``placement: slo``
(the default) a few other candidates are predicted too (the least loaded, and those
holding the most of the prompt) and the request goes to the one whose predicted TTFT and
TPOT use the smallest share of its class's targets (``slo_usage``) when that is not the
policy's pick (``qos-placed``): the prediction counts the prompt tokens each worker still
has to prefill ahead of it and its own uncached tokens, which the routing scores
(normalised counts) lose.  Classes that are always admitted keep the policy's pick.
With ``placement: policy`` the pick stands unless it would miss the targets and another
candidate would not (``qos-rerouted``).  Only when no
candidate would meet them is the request refused.  During warm-up (no learned TTFT fit)
the policy's pick stands.  In shadow mode nothing is refused or moved: would-be
refusals are counted and followed to their outcome.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.contracts.metrics import PREFIX
from splitserve.contracts.wire import ReleaseCall, RouteCall
from splitserve.components.router.qos import (
    AdmissionRequest,
    ClassResolution,
    Estimate,
    LoadSignals,
    PriorityClass,
    QosConfig,
    Verdict,
    admit,
    resolve_class,
)
from splitserve.components.router.qos.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S
from splitserve.components.router.qos.predictor import Calibration, LatencyPredictor

from .types import WorkerState

# log2(measured / predicted): 0 is exact, 1 is twice as slow as predicted.
LOG2_RATIO_BUCKETS = (-4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0,
                      1.5, 2.0, 3.0, 4.0)
MAX_ALTERNATIVES = 4  # other candidates judged when the policy's pick would miss
CONFUSION_OUTCOMES = ("refused", "admitted-met", "admitted-missed", "would-refuse-met",
                      "would-refuse-missed")


@dataclass(frozen=True)
class Admission:
    """A verdict, the worker it was predicted for and the prediction."""

    verdict: Verdict
    worker_id: int | None  # None when no worker could be judged
    estimate: Estimate | None
    rerouted: bool = False
    why: str = "qos-rerouted"  # the decision reason when rerouted


class QosMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.verdicts = Counter(f"{PREFIX}_qos_admissions_total",
                                "Admission verdicts by class, outcome and reason",
                                ["class_name", "outcome", "reason"], registry=registry)
        self.degradations = Counter(f"{PREFIX}_qos_degradations_total",
                                    "Degradation steps applied by class and kind",
                                    ["class_name", "kind"], registry=registry)
        self.est_ttft = Gauge(f"{PREFIX}_qos_estimated_ttft_ms",
                              "Latest TTFT estimate of an admission decision, by class",
                              ["class_name"], registry=registry)
        self.prefill_rate = Gauge(f"{PREFIX}_qos_prefill_ms_per_token",
                                  "TTFT fit of the pool: ms per token ahead or own",
                                  registry=registry)
        self.decode_rate = Gauge(f"{PREFIX}_qos_decode_ms_per_token",
                                 "TPOT fit of the pool at a batch of one (ms)",
                                 registry=registry)
        self.stall = Gauge(f"{PREFIX}_qos_stall_ms_per_token",
                           "What one prompt token's prefill stalls the answers decoding on "
                           "a worker, ms: charged by admission ('charged') and measured "
                           "from finished answers ('measured')", ["worker", "kind"],
                           registry=registry)
        self.samples = Counter(f"{PREFIX}_qos_rate_samples_total",
                               "Finished requests by how the predictor used their timings",
                               ["use"], registry=registry)
        self.error = Histogram(f"{PREFIX}_qos_prediction_log2_ratio",
                               "log2(measured / predicted) of admitted requests' TTFT and "
                               "TPOT (predictions from learned fits only), by class and "
                               "worker", ["kind", "class_name", "worker"],
                               buckets=LOG2_RATIO_BUCKETS, registry=registry)
        self.held = Counter(f"{PREFIX}_qos_held_total",
                            "Requests held instead of refused (qos.hold), by class, the "
                            "reason they were held for and how the hold ended (placed, "
                            "refused, cancelled, failed)", ["class_name", "reason", "outcome"],
                            registry=registry)
        self.holding = Gauge(f"{PREFIX}_qos_holding", "Requests held now", registry=registry)
        self.hold_judgments = Counter(f"{PREFIX}_qos_hold_judgments_total",
                                      "Held requests judged again (judged), or left held "
                                      "as nothing they wait for changed (unchanged)",
                                      ["result"], registry=registry)
        self.hold_seconds = Histogram(f"{PREFIX}_qos_hold_seconds",
                                      "How long held requests waited, by how the hold ended",
                                      ["outcome"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                            1.0, 2.0, 3.0, 5.0, 10.0),
                                      registry=registry)
        self.confusion = Counter(f"{PREFIX}_qos_confusion_total",
                                 "Admission against outcome: refused, admitted-met, "
                                 "admitted-missed, would-refuse-met, would-refuse-missed "
                                 "(shadow mode), by class and the worker it was predicted "
                                 "for ('none' when none could be)",
                                 ["class_name", "outcome", "worker"], registry=registry)


def log2_ratio(measured: float, predicted: float) -> float:
    """The calibration error of one prediction (both floored at 0.1 ms)."""
    return math.log2(max(measured, 0.1) / max(predicted, 0.1))


TRACE_ENV = "SPLITSERVE_QOS_TRACE"
"""A file to append one JSON line per first token to (its prediction, the queue it was
judged on and what was measured): a diagnostic for the admission benchmarks."""


def _jsonl_appender(path: str) -> Callable[[dict], None]:
    f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the gate

    def write(row: dict) -> None:
        f.write(json.dumps(row) + "\n")
    return write


class QosGate:
    """Decides admission per request and learns latencies from releases."""

    def __init__(self, config: QosConfig, registry: CollectorRegistry,
                 prefill_depth: Callable[[], int] = lambda: 0,
                 inflight_ttl_s: float = 600.0) -> None:
        self.config = config
        self.predictor = LatencyPredictor(config.estimator)
        self.metrics = QosMetrics(registry)
        self.prefill_depth = prefill_depth
        self.inflight_ttl_s = inflight_ttl_s
        trace_to = os.environ.get(TRACE_ENV)
        if trace_to:
            self.predictor.trace = _jsonl_appender(trace_to)

    def reconfigure(self, config: QosConfig) -> None:
        """Apply a new policy version; learned latencies are kept."""
        self.config = config

    def resolve(self, call: RouteCall) -> ClassResolution:
        """The request's class (before routing: the policy may use it)."""
        return resolve_class(call.priority, call.user, call.metadata, self.config)

    def _estimate(self, call: RouteCall, wid: int, cached_tokens: int, now: float,
                  held_ms: float, class_name: str, holding: bool = False,
                  restore_ms: float = 0.0):
        """The prediction for ``call`` (of class ``class_name``) on worker ``wid``, which
        holds ``cached_tokens`` of its prompt (only the rest is prefilled), copying some
        back from its lower KV tiers in ``restore_ms``; with ``holding``, the running
        answers' slack that only holding judges."""
        return self.predictor.predict(f"{wid:x}", len(call.token_ids) - cached_tokens,
                                      now, held_ms, output_tokens=call.max_tokens,
                                      class_name=class_name, running_slack=holding,
                                      restore_ms=restore_ms,
                                      headroom=self.config.hold.running_headroom,
                                      context_tokens=len(call.token_ids))

    def _judge(self, call: RouteCall, class_name: str, worker: WorkerState | None,
               wid: int, cached_tokens: int, now: float, depth: int,
               held_ms: float, holding: bool = False, restore_ms: float = 0.0) -> Admission:
        estimate = self._estimate(call, wid, cached_tokens, now, held_ms, class_name,
                                  holding, restore_ms)
        load = LoadSignals(prefill_queue_depth=depth,
                           decode_kv_usage=worker.kv_usage if worker is not None else 0.0)
        verdict = admit(AdmissionRequest(request_id=call.request_id, class_name=class_name,
                                         prompt_tokens=len(call.token_ids),
                                         max_tokens=max(1, call.max_tokens)),
                        estimate, self.config, load, holding=holding)
        if (not verdict.admit and verdict.reason == "tpot-slo-risk"
                and verdict.tpot_limit_ms is not None):
            # Retry when enough of the batch has ended, not after a fixed second.
            drain = self.predictor.tpot_drain_s(f"{wid:x}", verdict.tpot_limit_ms, now)
            if drain is not None:
                verdict = verdict.model_copy(update={"retry_after_s": min(
                    RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(drain)))})
        return Admission(verdict, wid, estimate)

    def check(self, call: RouteCall, workers: Sequence[WorkerState],
              cached: Mapping[int, int], now: float, record: bool,
              chosen: int | None = None, candidates: Sequence[int] | None = None,
              held: int = 0, slots: int = 1, waited_ms: float = 0.0,
              holding: bool = False,
              restore_ms: Mapping[int, float] | None = None) -> Admission:
        """The admission of one request (recorded in metrics and placed unless explaining).

        ``chosen``: the worker the routing policy picked (None: judge every candidate and
        take the admitted one predicted fastest); ``candidates``: the workers it could go
        to (default: ``workers``); ``cached``: prompt tokens cached per worker;
        ``held``: requests waiting in the admission queue ahead of it, ``slots``: how many
        run at once under its cap; they leave the queue as placed requests finish, one
        slot per learned request duration; ``waited_ms``: how long it has been held
        already (``qos.hold``), counted in every TTFT prediction; ``holding``: the caller
        holds a request turned away for its batch instead of refusing it (``admit``);
        ``restore_ms``: per worker, what copying the cached tokens it holds in its lower
        KV tiers back takes there (measured by the worker; they count in ``cached``).
        """
        self.predictor.expire(now, self.inflight_ttl_s)
        class_name = self.resolve(call).name
        by_id = {w.worker_id: w for w in workers}
        ids = list(candidates) if candidates is not None else list(by_id)
        depth = self.prefill_depth()
        service = self.predictor.service_ms
        held_ms = held / max(1, slots) * service if held and service else 0.0
        held_ms += max(0.0, waited_ms)

        restores = restore_ms or {}

        def judge(wid: int) -> Admission:
            return self._judge(call, class_name, by_id.get(wid), wid, cached.get(wid, 0),
                               now, depth, held_ms, holding, restores.get(wid, 0.0))

        first = judge(chosen) if chosen is not None else None
        enforce = self.config.mode == "enforce"
        if (enforce and first is not None and first.verdict.reason == "within-slo"
                and self.config.placement in ("slo", "slo-prefix")):
            # Admission is on for this class and its rules ran on learned fits: place it
            # where it uses the least of its targets.  The others are predicted only;
            # the one that would use less is judged in full (it must pass the rules too).
            cls = self.config.class_named(first.verdict.class_name)
            mine = slo_usage(first.estimate, cls)
            movable = ids
            if self.config.placement == "slo-prefix":
                # Only where as much of the prompt is held as on the pick: a request
                # moved off the worker holding its prefix, for a smaller batch or queue,
                # has the prefix computed again, the requests sharing it then find it on
                # two workers, and the whole fleet's prefill load rises.  Filtered before
                # the few alternatives are chosen, so that those are the best of these.
                kept = cached.get(chosen, 0)
                movable = [wid for wid in ids if cached.get(wid, 0) >= kept]
            better = min(
                ((usage, wid) for wid in self._alternatives(movable, chosen, cached)
                 if (usage := slo_usage(self._estimate(
                     call, wid, cached.get(wid, 0), now, held_ms, cls.name,
                     restore_ms=restores.get(wid, 0.0)), cls)) < mine),
                default=None)
            if better is not None:
                moved = judge(better[1])
                if moved.verdict.admit:
                    first = replace(moved, rerouted=True, why="qos-placed")
        elif first is None or (not first.verdict.admit and enforce):
            judged = [judge(w) for w in self._alternatives(ids, chosen, cached)]
            fits = [a for a in judged if a.verdict.admit and not a.verdict.would_reject]
            if fits:
                best = min(fits, key=lambda a: a.verdict.est_ttft_ms or 0.0)
                first = replace(best, rerouted=first is not None)
            elif first is None and judged:
                first = min(judged, key=lambda a: a.verdict.est_ttft_ms or 0.0)
        if first is None:  # no worker to judge: the router answers no-workers anyway
            first = Admission(admit(AdmissionRequest(
                request_id=call.request_id, class_name=class_name,
                prompt_tokens=len(call.token_ids), max_tokens=max(1, call.max_tokens)),
                None, self.config), None, None)
        if waited_ms > 0 and first.estimate is not None:
            # The verdict judged the wait in the client's TTFT; the worker's fits learn
            # from the placement on, so the prediction kept for them leaves it out.
            est = first.estimate
            first = replace(first, estimate=est.model_copy(update={
                "est_ttft_ms": max(est.unloaded_ttft_ms, est.est_ttft_ms - waited_ms),
                "queue_wait_ms": max(0.0, est.queue_wait_ms - waited_ms),
                "waited_ms": waited_ms}))
        if record:
            self.record(call, first, now)
        return first

    def _alternatives(self, ids: Sequence[int], chosen: int | None,
                      cached: Mapping[int, int]) -> list[int]:
        """The other candidates worth judging, a few so that a large fleet stays cheap:
        the least loaded (less work ahead and a smaller batch predict lower) and those
        holding the most of the prompt (fewer tokens to prefill)."""
        others = [w for w in ids if w != chosen]
        if len(others) <= MAX_ALTERNATIVES:
            return others
        light = sorted(others, key=lambda w: self.predictor.load(f"{w:x}"))
        warm = sorted((w for w in others if cached.get(w, 0) > 0),
                      key=lambda w: -cached[w])
        return list(dict.fromkeys([*light[:MAX_ALTERNATIVES], *warm[:MAX_ALTERNATIVES // 2]]))

    def record(self, call: RouteCall, admission: Admission, now: float) -> dict | None:
        """Count a verdict that takes effect and, for an admission, follow the request
        on its worker until its release (``check`` with record, or the verdict a request
        held in the admission queue leaves with).  Returns what it follows the request
        with (``ticket``), for the sibling processes to follow it alike."""
        verdict = admission.verdict
        ticket = self.ticket(call, admission)
        if ticket is not None:
            self.predictor.place(call.request_id, f"{admission.worker_id:x}",
                                 admission.estimate, now, **ticket)
        if not verdict.admit:
            outcome = "rejected"
            worker = "none" if admission.worker_id is None else f"{admission.worker_id:x}"
            self.metrics.confusion.labels(verdict.class_name, "refused", worker).inc()
        else:
            outcome = "shadow-rejected" if verdict.would_reject else "admitted"
        self.metrics.verdicts.labels(verdict.class_name, outcome, verdict.reason).inc()
        for step in verdict.degrade:
            self.metrics.degradations.labels(verdict.class_name, step.kind).inc()
        if verdict.est_ttft_ms is not None:
            self.metrics.est_ttft.labels(verdict.class_name).set(verdict.est_ttft_ms)
        return ticket

    def ticket(self, call: RouteCall, admission: Admission) -> dict | None:
        """What the predictor follows an admitted request with besides its worker and
        estimate (``LatencyPredictor.place``'s keywords); None when it follows nothing
        (refused, or no worker could be judged)."""
        verdict = admission.verdict
        if not verdict.admit or admission.worker_id is None or admission.estimate is None:
            return None
        cls = self.config.class_named(verdict.class_name)
        return {"class_name": verdict.class_name, "would_reject": verdict.would_reject,
                "max_tokens": verdict.max_tokens or call.max_tokens,
                "tpot_budget_ms": cls.tpot_ms if cls is not None and cls.may_reject
                else 0.0}

    def refused(self, class_name: str, reason: str) -> None:
        """Count a refusal made outside ``check`` (the admission queue shed it)."""
        self.metrics.verdicts.labels(class_name, "rejected", reason).inc()
        self.metrics.confusion.labels(class_name, "refused", "none").inc()

    def first_token(self, request_id: str, now: float) -> None:
        """A placed request's first token reached the frontend (which reports it)."""
        self.predictor.first_token(request_id, now)

    def decode_progress(self, request_id: str, tokens: int, now: float) -> None:
        """A placed request streamed ``tokens`` output tokens (the frontend reports it)."""
        self.predictor.decode_progress(request_id, tokens, now)

    def observe(self, call: ReleaseCall, now: float) -> Calibration | None:
        """Learn from a finished request's timings (release calls carry them) and record
        its prediction against what was measured; returns that calibration."""
        cal = self.predictor.finish(call.request_id, now, ok=call.outcome == "ok",
                                    ttft_s=call.ttft_s, duration_s=call.duration_s,
                                    output_tokens=call.output_tokens)
        if cal is None:
            self.metrics.samples.labels("untracked" if call.outcome == "ok" else
                                        "not-finished").inc()
            return None
        self.metrics.samples.labels("learned").inc()
        if cal.ttft_observed:
            self.metrics.error.labels("ttft", cal.class_name, cal.worker).observe(
                log2_ratio(cal.measured_ttft_ms, cal.predicted_ttft_ms))
        if cal.tpot_observed and cal.measured_tpot_ms is not None:
            self.metrics.error.labels("tpot", cal.class_name, cal.worker).observe(
                log2_ratio(cal.measured_tpot_ms, cal.predicted_tpot_ms))
        self.metrics.confusion.labels(cal.class_name, outcome_of(cal, self.config),
                                      cal.worker).inc()
        measured = self.predictor.measured_stall_per_token(cal.worker)
        if measured is not None:
            self.metrics.stall.labels(cal.worker, "measured").set(measured)
            self.metrics.stall.labels(cal.worker, "charged").set(
                self.predictor.stall_per_token(cal.worker, now))
        per_token, tpot_one = self.predictor.pool_rates()
        self.metrics.prefill_rate.set(per_token)
        self.metrics.decode_rate.set(tpot_one)
        return cal


def slo_usage(est: Estimate | None, cls: PriorityClass | None) -> float:
    """The share of its class's targets a request is predicted to use on the worker it was
    predicted for: est TTFT / TTFT target + est TPOT / TPOT target (the TPOT term only when
    the prediction knows the batch it joins).  Lower is better; summed, not the larger
    of the two, so that a worker with prompts queued ahead is dearer than one without
    even when both would meet the TTFT target."""
    if est is None or cls is None or est.prefill_source == "warmup":
        return math.inf
    usage = est.est_ttft_ms / cls.ttft_ms
    if est.tpot_batch > 0 and est.decode_source != "warmup":
        usage += est.est_tpot_ms / cls.tpot_ms
    return usage


def outcome_of(cal: Calibration, config: QosConfig) -> str:
    """The confusion-table cell of a finished admitted request: did it meet its class's
    TTFT and TPOT targets, and would shadow mode have refused it.  Its TTFT is the
    client's: the wait before its placement (in the frontend, held) and the measured
    time from the placement to its first token."""
    cls = config.class_named(cal.class_name) or config.class_named(config.default_class)
    assert cls is not None
    met = cal.waited_ms + cal.measured_ttft_ms <= cls.ttft_ms and (
        cal.measured_tpot_ms is None or cal.measured_tpot_ms <= cls.tpot_ms)
    return ("would-refuse-" if cal.would_reject else "admitted-") + ("met" if met else "missed")
