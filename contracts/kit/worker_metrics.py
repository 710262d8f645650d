"""Prometheus metrics of a worker (names documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.contracts.metrics import PREFIX


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

    def update(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)
