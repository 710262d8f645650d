"""QoS admission in the router process: class resolution, the estimate, the verdict.

Glue between the pure QoS core (`components/qos/`) and what the router observes: its
own placements and admission queue, the routable workers, the prefill-queue depth, and
every finished request's timings (release calls), which feed the prefill fit (fixed +
per token) and the decode rate.  Workers' load reports feed only the degradation steps
(KV usage): what waits in an engine is already among this router's placements.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.common.metrics import PREFIX
from splitserve.components.protocol import ReleaseCall, RouteCall
from splitserve.components.qos import (
    AdmissionRequest,
    Backlog,
    LoadSignals,
    QosConfig,
    Verdict,
    admit,
    build_estimator,
    resolve_class,
)

from .types import WorkerState

DECODE_POOL = "decode"
RATE_WINDOW_S = 5.0
MIN_RATE_SPAN_S = 1.0  # a busy period shorter than this is measured over this long
MIN_COMPLETIONS = 5  # completions in the busy period before its rate is trusted
BOOTSTRAP_SAMPLES = 8  # completions without an unloaded one before the fastest is taken
MAX_TRACKED = 100_000  # admissions remembered until their release (bounds memory)


@dataclass(frozen=True)
class _Sample:
    """One finished request's timings, kept while no unloaded sample has been seen."""

    worker: str
    computed: int
    ttft_s: float
    output_tokens: int
    duration_s: float | None


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
                                  "Prefill time per prompt token, beyond the fixed part (pool)",
                                  registry=registry)
        self.decode_rate = Gauge(f"{PREFIX}_qos_decode_ms_per_token",
                                 "EMA of decode time per output token (pool)", registry=registry)
        self.samples = Counter(f"{PREFIX}_qos_rate_samples_total",
                               "Finished requests by how the estimator used their timings",
                               ["use"], registry=registry)


class QosGate:
    """Decides admission per request and learns latencies from releases."""

    def __init__(self, config: QosConfig, registry: CollectorRegistry,
                 prefill_depth: Callable[[], int] = lambda: 0,
                 prefill_workers: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.estimator = build_estimator(config)
        self.metrics = QosMetrics(registry)
        self.prefill_depth = prefill_depth
        self.prefill_workers = prefill_workers
        # Completion times since the fleet was last seen empty (at most RATE_WINDOW_S
        # old): the rate at which a full fleet frees a slot.
        self.completions: deque[float] = deque()
        self.busy_since: float | None = None
        self.service_ms: float | None = None  # EMA of unloaded request durations
        self.fleet_workers = 1  # routable workers, as last reported to observe()
        # In-flight count when each admitted request was placed: a request placed into
        # a fleet with a free slot ran unloaded, whatever arrived after it.
        self.load_at_admission: OrderedDict[str, int] = OrderedDict()
        self.loaded_samples: deque[_Sample] = deque(maxlen=BOOTSTRAP_SAMPLES)

    def slots(self, workers: int) -> int:
        """Requests the fleet runs at once without any of them waiting for another: one
        per worker, or the admission queue's per-worker cap when it is on (then what
        runs on a worker is what the router let through, and its speed is learned at
        that concurrency)."""
        return max(1, workers) * max(1, self.config.queue.max_inflight_per_worker)

    def _idle(self, now: float) -> None:
        """Nothing in flight: a new busy period starts; the old one's completions say
        nothing about how fast a full fleet drains."""
        self.completions.clear()
        self.busy_since = now

    def completion_rate(self, now: float, slots: int) -> float | None:
        """Completions per second of a full fleet, or None before anything finished.

        Measured over the current busy period (its last RATE_WINDOW_S), not the whole
        window: after an idle spell a window-wide average counts the idle time as
        slowness.  A busy period younger than the window has not finished much yet (its
        first requests are still running), so until then the rate is at least what the
        slots deliver at the learned unloaded duration (``slots / service``), which is
        also the rate before MIN_COMPLETIONS in the busy period.
        """
        while self.completions and now - self.completions[0] > RATE_WINDOW_S:
            self.completions.popleft()
        busy = RATE_WINDOW_S if self.busy_since is None else now - self.busy_since
        measured = None
        if len(self.completions) >= MIN_COMPLETIONS:
            measured = len(self.completions) / max(MIN_RATE_SPAN_S, min(RATE_WINDOW_S, busy))
        nominal = None
        if self.service_ms is not None and self.service_ms > 0:
            nominal = slots / (self.service_ms / 1000.0)
        if measured is not None and (busy >= RATE_WINDOW_S or nominal is None):
            return measured
        return max(measured or 0.0, nominal or 0.0) or None

    def queue_wait_ms(self, inflight: int, slots: int, now: float) -> float:
        """Time a new request waits for a free slot, from what this router saw.

        With ``inflight`` requests placed or queued by this router and ``slots`` that
        run at once, the newcomer finds a slot at once while ``inflight < slots``; else
        ``inflight + 1 - slots`` requests must finish first, and a full fleet finishes
        them at its measured completion rate.  Queueing inside engines that report
        nothing (Dynamo's mocker) shows up this way too, since the router counts what it
        placed.

        Why not Little's law ``(L + 1) / lambda - S``: below saturation lambda is the
        arrival rate, not the fleet's speed, and ``1 / lambda`` (the gap between
        arrivals) is not a wait.  On an idle fleet after a few requests it said about a
        second for a 4-token prompt, and rejecting everything then stopped the
        completions that would have corrected it.
        """
        ahead = inflight + 1 - slots
        if ahead <= 0:
            return 0.0
        rate = self.completion_rate(now, slots)
        return 0.0 if rate is None else ahead / rate * 1000.0

    def reconfigure(self, config: QosConfig) -> None:
        """Apply a new policy version; learned latencies are kept."""
        self.config = config

    def check(self, call: RouteCall, workers: tuple[WorkerState, ...], cached_tokens: int,
              now: float, record: bool, inflight: int = 0) -> Verdict:
        """The admission verdict for one request (recorded in metrics unless explaining)."""
        resolution = resolve_class(call.priority, call.user, call.metadata, self.config)
        if inflight == 0:
            self._idle(now)
        depth = self.prefill_depth()
        # The workers' own queue reports are left out: what waits in an engine was placed
        # by this router and is counted in ``inflight`` already, and a report is up to an
        # interval old (counting both rejected on a fleet that had drained).
        backlog = Backlog(at=now, prefill_queued_requests=depth,
                          prefill_workers=max(1, self.prefill_workers()))
        uncached = max(0, len(call.token_ids) - cached_tokens)
        # The rates are learned from whole TTFTs, which hold the first token already.
        estimate = self.estimator.estimate(uncached, backlog, now, prefill_pool=DECODE_POOL,
                                           decode_pool=DECODE_POOL, first_step=False)
        wait = self.queue_wait_ms(inflight, self.slots(len(workers) or self.fleet_workers),
                                  now)
        if wait > 0:
            estimate = estimate.model_copy(update={
                "est_ttft_ms": estimate.est_ttft_ms + wait,
                "queue_wait_ms": estimate.queue_wait_ms + wait})
        kv = max((w.kv_usage for w in workers), default=0.0)
        verdict = admit(AdmissionRequest(request_id=call.request_id, class_name=resolution.name,
                                         prompt_tokens=len(call.token_ids),
                                         max_tokens=max(1, call.max_tokens)),
                        estimate, self.config, LoadSignals(prefill_queue_depth=depth,
                                                           decode_kv_usage=kv))
        if record:
            self.record(call, verdict, inflight)
        return verdict

    def record(self, call: RouteCall, verdict: Verdict, inflight: int) -> None:
        """Count a verdict that takes effect (``check`` with record, or a verdict reached
        before queueing that is acted on when the request leaves the queue)."""
        if verdict.admit:
            self.load_at_admission[call.request_id] = inflight
            while len(self.load_at_admission) > MAX_TRACKED:
                self.load_at_admission.popitem(last=False)
        outcome = "admitted" if verdict.admit else "rejected"
        self.metrics.verdicts.labels(verdict.class_name, outcome, verdict.reason).inc()
        for step in verdict.degrade:
            self.metrics.degradations.labels(verdict.class_name, step.kind).inc()
        if verdict.est_ttft_ms is not None:
            self.metrics.est_ttft.labels(verdict.class_name).set(verdict.est_ttft_ms)

    def observe(self, call: ReleaseCall, now: float, inflight: int, workers: int) -> None:
        """Learn from a finished request's timings (release calls carry them).

        Called after the release left ``inflight`` requests placed, on ``workers``
        routable workers.  Speeds are learned from requests that ran unloaded: placed
        while the fleet had a free slot (fewer requests in flight than ``slots``).  The
        placement decides, not the moment of completion: a request placed behind a
        queue and finishing once it drained waited all the same, and teaching its TTFT
        as an unloaded speed made every later estimate too high.  (Requests placed
        without a record, for which the placement is unknown, are judged by the count
        at completion.)  Under load a request's times include queueing, which
        ``queue_wait_ms`` accounts for separately.  A fleet overloaded from its first
        request never yields such a sample: after ``BOOTSTRAP_SAMPLES`` completions the
        fastest one per prompt token (the least queued, an upper bound of the unloaded
        speed) seeds the rates, so admission engages instead of answering 'no-estimate'
        for ever; later unloaded samples refine them.
        """
        at_admission = self.load_at_admission.pop(call.request_id, None)
        self.fleet_workers = max(1, workers)
        if call.outcome == "ok" and call.ttft_s is not None:
            self._sample(call, at_admission, inflight, now)
        if inflight == 0:
            self._idle(now)

    def _sample(self, call: ReleaseCall, at_admission: int | None, inflight: int,
                now: float) -> None:
        self.completions.append(now)
        sample = _Sample(f"{call.worker_id:x}", max(1, call.prompt_tokens - call.cached_tokens),
                         call.ttft_s or 0.0, call.output_tokens, call.duration_s)
        slots = self.slots(self.fleet_workers)
        placed_at = inflight if at_admission is None else at_admission
        if placed_at < slots:
            self.metrics.samples.labels("unloaded").inc()
            self._learn(sample, now)
            self.loaded_samples.clear()
            return
        self.metrics.samples.labels("loaded-skipped").inc()
        if self.estimator.rate("prefill", DECODE_POOL).source != "warmup":
            return
        self.loaded_samples.append(sample)
        if len(self.loaded_samples) == BOOTSTRAP_SAMPLES:
            self.metrics.samples.labels("bootstrap").inc()
            decoded = [x for x in self.loaded_samples if x.output_tokens > 1] or \
                list(self.loaded_samples)
            self._learn(min(decoded, key=lambda x: x.ttft_s / x.computed), now)
            self.loaded_samples.clear()

    def _learn(self, sample: _Sample, now: float) -> None:
        if sample.duration_s is not None:
            ms = sample.duration_s * 1000.0
            self.service_ms = ms if self.service_ms is None else 0.8 * self.service_ms + 0.2 * ms
        self.estimator.observe_prefill(sample.worker, DECODE_POOL, sample.computed,
                                       sample.ttft_s, now)
        if sample.output_tokens > 1 and sample.duration_s is not None:
            self.estimator.observe_decode(sample.worker, DECODE_POOL, sample.output_tokens - 1,
                                          max(0.0, sample.duration_s - sample.ttft_s), now)
        self.metrics.prefill_rate.set(self.estimator.rate("prefill", DECODE_POOL).value)
        self.metrics.decode_rate.set(self.estimator.rate("decode", DECODE_POOL).value)
