"""Prometheus metrics of the frontend (names documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.contracts.metrics import PREFIX, latency_buckets


class FrontendMetrics:
    """One instance per frontend process, on its own registry (served at /metrics)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_frontend_requests_total",
                                "Requests by endpoint, outcome, HTTP status and served model "
                                "(\"\" before the body named one the graph serves)",
                                ["endpoint", "outcome", "status", "model"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_frontend_ttft_seconds",
                              "Time to first token, from request arrival",
                              ["model"], buckets=latency_buckets(), registry=r)
        self.itl = Histogram(f"{PREFIX}_frontend_itl_seconds",
                             "Inter-token latency between streamed tokens",
                             ["model"], buckets=latency_buckets(), registry=r)
        self.duration = Histogram(f"{PREFIX}_frontend_request_duration_seconds",
                                  "End-to-end request latency", buckets=latency_buckets(),
                                  registry=r)
        self.inflight = Gauge(f"{PREFIX}_frontend_inflight_requests",
                              "Requests being served now", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_frontend_prompt_tokens_total",
                                     "Prompt tokens of admitted requests", ["model"],
                                     registry=r)
        self.output_tokens = Counter(f"{PREFIX}_frontend_output_tokens_total",
                                     "Generated tokens streamed to clients", ["model"],
                                     registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_frontend_cached_prompt_tokens_total",
                                     "Prompt tokens served from a worker's prefix cache",
                                     ["model"], registry=r)
