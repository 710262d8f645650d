"""QoS admission in the router process: class resolution, the estimate, the verdict.

Glue between the pure QoS core (`components/qos/`) and what the router observes: the
fleet's queues (load reports, its own placements, the prefill-queue depth) and every
finished request's timings (release calls), which feed the per-token EMAs.
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
                                  "EMA of prefill time per prompt token (pool)",
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
        self.completions: deque[float] = deque()
        self.service_ms: float | None = None  # EMA of unloaded request duration
        self.mix: tuple[float, float] | None = None  # EMA of (computed prompt, output) tokens
        # In-flight count when each admitted request was placed: a request admitted into
        # a fleet with a free worker ran unloaded, whatever arrived after it.
        self.load_at_admission: OrderedDict[str, int] = OrderedDict()
        self.loaded_samples: deque[_Sample] = deque(maxlen=BOOTSTRAP_SAMPLES)

    def _queue_wait_ms(self, inflight: int, now: float) -> float:
        """Waiting time ahead of a new request by Little's law, from what the router saw.

        The per-token EMAs describe unloaded speed; queueing inside engines (which report
        nothing, like Dynamo's mocker) shows up only as more requests in flight than the
        fleet completes.  W = (L + 1) / lambda is the expected time in system, with L the
        requests this router has in flight and lambda its completion rate over the last
        few seconds; minus the unloaded duration S it is the time spent waiting.

        S is the unloaded duration of the current request mix: the learned per-token
        speeds (unloaded samples only) applied to the mean prompt and answer lengths of
        every recent completion.  A duration averaged over unloaded requests alone would
        describe whatever happened to run unloaded (say a first burst of long answers)
        and misjudge the wait for the rest of the run.
        """
        while self.completions and now - self.completions[0] > RATE_WINDOW_S:
            self.completions.popleft()
        service_ms = self._mix_service_ms()
        if len(self.completions) < 5 or service_ms is None:
            return 0.0
        rate = len(self.completions) / RATE_WINDOW_S
        return max(0.0, (inflight + 1) / rate * 1000.0 - service_ms)

    def _mix_service_ms(self) -> float | None:
        prefill = self.estimator.rate("prefill", DECODE_POOL)
        decode = self.estimator.rate("decode", DECODE_POOL)
        if prefill.source == "warmup" or decode.source == "warmup" or self.mix is None:
            return self.service_ms
        prompt, output = self.mix
        return prompt * prefill.value + max(1.0, output) * decode.value

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

        Speeds are learned from requests that ran unloaded: admitted while the fleet had
        a free worker (no more requests in flight than workers, this one included), or
        finishing while it has one.  Under load a request's times include queueing, which
        the queue-wait term accounts for separately.  A fleet overloaded from its first
        request never yields such a sample: after ``BOOTSTRAP_SAMPLES`` completions the
        fastest one per prompt token (the least queued, an upper bound of the unloaded
        speed) seeds the rates, so admission engages instead of answering 'no-estimate'
        for ever; later unloaded samples refine them.
        """
        at_admission = self.load_at_admission.pop(call.request_id, None)
        if call.outcome != "ok" or call.ttft_s is None:
            return
        self.completions.append(now)
        sample = _Sample(f"{call.worker_id:x}", max(1, call.prompt_tokens - call.cached_tokens),
                         call.ttft_s, call.output_tokens, call.duration_s)
        if self.mix is None:
            self.mix = (float(sample.computed), float(sample.output_tokens))
        else:
            self.mix = (0.8 * self.mix[0] + 0.2 * sample.computed,
                        0.8 * self.mix[1] + 0.2 * sample.output_tokens)
        slots = max(1, workers)
        unloaded = inflight <= slots or (at_admission is not None and at_admission < slots)
        if unloaded:
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
