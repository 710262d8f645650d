"""Prometheus metrics of a worker (names documented in docs/metrics.md)."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from splitserve.contracts.metrics import PREFIX

KV_EVENT_DROPS: Tally[str] = Tally()
"""Engine KV events this process's relay could not pass on, by reason (an engine's
relay counts them; one engine per worker process): ``offload-without-tokens`` (an
offload-tier store with no tokens to key it), ``external-tier`` (a medium this project
does not track), ``token-count-mismatch`` (a store whose tokens do not fill its
blocks)."""


class _KvEventDrops:
    """``splitserve_worker_kv_events_dropped_total{reason}`` from ``KV_EVENT_DROPS``."""

    def collect(self):
        family = CounterMetricFamily(
            f"{PREFIX}_worker_kv_events_dropped", "Engine KV events the worker's relay "
            "could not pass on to the routers, by reason", labels=["reason"])
        for reason, n in sorted(KV_EVENT_DROPS.items()):
            family.add_metric([reason], n)
        yield family


class WorkerMetrics:
    """Gauges refreshed from the engine's stats at every load report."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(f"{PREFIX}_worker_running_requests", "Requests being decoded",
                             registry=r)
        self.waiting = Gauge(f"{PREFIX}_worker_waiting_requests",
                             "Requests queued for admission", registry=r)
        self.kv_used = Gauge(f"{PREFIX}_worker_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge(f"{PREFIX}_worker_kv_blocks_total", "KV block capacity",
                              registry=r)
        self.kv_usage = Gauge(f"{PREFIX}_worker_kv_usage_ratio", "KV blocks used / total",
                              registry=r)
        self.requests = Counter(f"{PREFIX}_worker_requests_total",
                                "Requests by outcome", ["outcome"], registry=r)
        self.load_report_failures = Counter(
            f"{PREFIX}_worker_load_report_failures_total",
            "Load reports that could not be sampled or published (routers then see "
            "this worker's load late)", registry=r)
        r.register(_KvEventDrops())

    def update(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)
