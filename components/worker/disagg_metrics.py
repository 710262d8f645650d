"""Prometheus metrics of a decode worker's offload decisions (names in docs/metrics.md).

Shared by every decode worker, whatever its engine (torch or mocker), so dashboards
read the same series from both; this module imports no engine.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from splitserve.common.metrics import PREFIX, latency_buckets


class DisaggMetrics:
    """Offload decisions and fallbacks, on the worker's registry."""

    def __init__(self, registry) -> None:
        self.decisions = Counter(f"{PREFIX}_disagg_decisions_total",
                                 "Offload decisions by where and why", ["where", "reason"],
                                 registry=registry)
        self.fallbacks = Counter(f"{PREFIX}_disagg_fallbacks_total",
                                 "Remote prefills that ended as local prefills, by reason",
                                 ["reason"], registry=registry)
        self.remote_wait = Histogram(f"{PREFIX}_disagg_remote_prefill_seconds",
                                     "From enqueue to KV arrival", buckets=latency_buckets(),
                                     registry=registry)
