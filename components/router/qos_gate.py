"""QoS admission in the router process: class resolution, the estimate, the verdict.

Glue between the pure QoS core (`components/qos/`) and what the router observes: the
fleet's queues (load reports, its own placements, the prefill-queue depth) and every
finished request's timings (release calls), which feed the per-token EMAs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

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
                                  "EMA of prefill time per prompt token (pool)",
                                  registry=registry)
        self.decode_rate = Gauge(f"{PREFIX}_qos_decode_ms_per_token",
                                 "EMA of decode time per output token (pool)", registry=registry)


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
        self.completions: deque[float] = deque()
        self.service_ms: float | None = None  # EMA of unloaded request duration

    def _queue_wait_ms(self, inflight: int, now: float) -> float:
        """Waiting time ahead of a new request by Little's law, from what the router saw.

        The per-token EMAs describe unloaded speed; queueing inside engines (which report
        nothing, like Dynamo's mocker) shows up only as more requests in flight than the
        fleet completes.  W = (L + 1) / lambda is the expected time in system, with L the
        requests this router has in flight and lambda its completion rate over the last
        few seconds; minus the unloaded duration S it is the time spent waiting.
        """
        while self.completions and now - self.completions[0] > RATE_WINDOW_S:
            self.completions.popleft()
        if len(self.completions) < 5 or self.service_ms is None:
            return 0.0
        rate = len(self.completions) / RATE_WINDOW_S
        return max(0.0, (inflight + 1) / rate * 1000.0 - self.service_ms)

    def reconfigure(self, config: QosConfig) -> None:
        """Apply a new policy version; learned latencies are kept."""
        self.config = config

    def check(self, call: RouteCall, workers: tuple[WorkerState, ...], cached_tokens: int,
              now: float, record: bool, inflight: int = 0) -> Verdict:
        """The admission verdict for one request (recorded in metrics unless explaining)."""
        resolution = resolve_class(call.priority, call.user, call.metadata, self.config)
        depth = self.prefill_depth()
        backlog = Backlog(
            at=now, prefill_queued_requests=depth,
            prefill_workers=max(1, self.prefill_workers()),
            decode_queued_requests=sum(w.waiting_requests for w in workers))
        uncached = max(0, len(call.token_ids) - cached_tokens)
        estimate = self.estimator.estimate(uncached, backlog, now, prefill_pool=DECODE_POOL,
                                           decode_pool=DECODE_POOL)
        wait = self._queue_wait_ms(inflight, now)
        if wait > 0:
            estimate = estimate.model_copy(update={"est_ttft_ms": estimate.est_ttft_ms + wait})
        kv = max((w.kv_usage for w in workers), default=0.0)
        verdict = admit(AdmissionRequest(request_id=call.request_id, class_name=resolution.name,
                                         prompt_tokens=len(call.token_ids),
                                         max_tokens=max(1, call.max_tokens)),
                        estimate, self.config, LoadSignals(prefill_queue_depth=depth,
                                                           decode_kv_usage=kv))
        if record:
            outcome = "admitted" if verdict.admit else "rejected"
            self.metrics.verdicts.labels(verdict.class_name, outcome, verdict.reason).inc()
            for step in verdict.degrade:
                self.metrics.degradations.labels(verdict.class_name, step.kind).inc()
            if verdict.est_ttft_ms is not None:
                self.metrics.est_ttft.labels(verdict.class_name).set(verdict.est_ttft_ms)
        return verdict

    def observe(self, call: ReleaseCall, now: float, inflight: int, workers: int) -> None:
        """Learn from a finished request's timings (release calls carry them).

        Speeds are learned only while the fleet is lightly loaded (no more requests in
        flight than workers): under load a request's times include queueing, which the
        queue-wait term accounts for separately.
        """
        if call.outcome != "ok" or call.ttft_s is None:
            return
        self.completions.append(now)
        if inflight > max(1, workers):
            return
        if call.duration_s is not None:
            ms = call.duration_s * 1000.0
            self.service_ms = ms if self.service_ms is None else 0.8 * self.service_ms + 0.2 * ms
        worker = f"{call.worker_id:x}"
        computed = max(1, call.prompt_tokens - call.cached_tokens)
        self.estimator.observe_prefill(worker, DECODE_POOL, computed, call.ttft_s, now)
        if call.output_tokens > 1 and call.duration_s is not None:
            self.estimator.observe_decode(worker, DECODE_POOL, call.output_tokens - 1,
                                          max(0.0, call.duration_s - call.ttft_s), now)
        self.metrics.prefill_rate.set(self.estimator.rate("prefill", DECODE_POOL).value)
        self.metrics.decode_rate.set(self.estimator.rate("decode", DECODE_POOL).value)
