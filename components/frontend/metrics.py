"""Prometheus metrics of the frontend (names documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.contracts.metrics import PREFIX, latency_buckets

MODEL_LABELS = ("model", "base_model")


class FrontendMetrics:
    """One instance per frontend process, on its own registry (served at /metrics).

    ``model`` is the name the client sent (a served model, or a LoRA adapter served on
    one); ``base_model`` the served model whose workers serve it (the adapter's base, or
    ``model`` itself): the planner and dashboards count a pool's load by it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_frontend_requests_total",
                                "Requests by endpoint, outcome, HTTP status and served model "
                                "(\"\" before the body named one the graph serves) and its "
                                "base model", ["endpoint", "outcome", "status", "model",
                                               "base_model"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_frontend_ttft_seconds",
                              "Time to first token, from request arrival",
                              MODEL_LABELS, buckets=latency_buckets(), registry=r)
        self.itl = Histogram(f"{PREFIX}_frontend_itl_seconds",
                             "Inter-token latency between streamed tokens",
                             MODEL_LABELS, buckets=latency_buckets(), registry=r)
        self.duration = Histogram(f"{PREFIX}_frontend_request_duration_seconds",
                                  "End-to-end request latency", buckets=latency_buckets(),
                                  registry=r)
        self.loop_lag = Gauge(f"{PREFIX}_frontend_event_loop_lag_seconds",
                              "How far behind the event loop runs (largest recent "
                              "lateness of a 20 ms tick; 1 s with no request in flight)", registry=r)
        self.inflight = Gauge(f"{PREFIX}_frontend_inflight_requests",
                              "Requests being served now", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_frontend_prompt_tokens_total",
                                     "Prompt tokens of admitted requests", MODEL_LABELS,
                                     registry=r)
        self.output_tokens = Counter(f"{PREFIX}_frontend_output_tokens_total",
                                     "Generated tokens streamed to clients", MODEL_LABELS,
                                     registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_frontend_cached_prompt_tokens_total",
                                     "Prompt tokens served from a worker's prefix cache",
                                     MODEL_LABELS, registry=r)
