"""Prometheus metrics of a decode worker's offload decisions (names in docs/metrics.md).

Shared by every decode and prefill worker, whatever its engine, so dashboards read the
same series from all of them; this module imports no engine.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from splitserve.contracts.metrics import PREFIX, latency_buckets

from .latency_metrics import PrefillLatency


class DisaggMetrics:
    """Offload decisions and fallbacks, on the worker's registry."""

    def __init__(self, registry) -> None:
        self.registry = registry
        self.decisions = Counter(f"{PREFIX}_disagg_decisions_total",
                                 "Offload decisions by where and why", ["where", "reason"],
                                 registry=registry)
        self.fallbacks = Counter(f"{PREFIX}_disagg_fallbacks_total",
                                 "Remote prefills that ended as local prefills, by reason",
                                 ["reason"], registry=registry)
        self.affinity = Counter(f"{PREFIX}_disagg_prefill_affinity_total",
                                "Remote prefill jobs by where they were queued: for the "
                                "prefill worker holding their prefix (held) or shared, and "
                                "why", ["reason"], registry=registry)
        self.affinity_shared = Counter(
            f"{PREFIX}_disagg_prefill_affinity_shared_total", "Prefix affinity messages "
            "between a pool's decode workers (prefill_affinity.share): sent, received from "
            "another decode worker, unreadable", ["direction"], registry=registry)
        self.remote_wait = Histogram(f"{PREFIX}_disagg_remote_prefill_seconds",
                                     "From enqueue to KV arrival", buckets=latency_buckets(),
                                     registry=registry)
        self.prefill_speed = Gauge(
            f"{PREFIX}_disagg_prefill_seconds_per_token", "The stall guard's prefill speed "
            "(protect_tpot_ms): learnt from this worker's local prefills (source=local) and "
            "from the prefill workers' reports (source=prefill_workers); 0 until learnt",
            ["source"], registry=registry)

    def watch_guard(self, guard) -> None:
        """Read the stall guard's learnt speeds at each scrape."""
        self.prefill_speed.labels("local").set_function(lambda: guard.local_spt or 0.0)
        self.prefill_speed.labels("prefill_workers").set_function(
            lambda: guard.remote_spt or 0.0)


class PrefillMetrics:
    """A prefill worker's job metrics, whatever its engine (on a mocker fleet the
    transfer time is the engine's simulated one and no bytes are counted).

    ``pool`` and ``model`` label the same times again in the "latency by pool" series
    (``latency_metrics.PrefillLatency``; the shell passes ``worker_labels``): the
    unlabelled ``compute`` and ``transfer`` histograms stay as they were (the
    disaggregated TTFT benchmark reads them by their bare sample names)."""

    def __init__(self, registry, pool: str = "", model: str = "") -> None:
        self.registry = registry
        self.latency = PrefillLatency(registry, pool, model)
        self.jobs = Counter(f"{PREFIX}_prefill_jobs_total", "Prefill jobs by outcome",
                            ["outcome"], registry=registry)
        self.taken = Counter(f"{PREFIX}_prefill_jobs_taken_total",
                             "Prefill jobs taken, by queue: shared, own (queued for this "
                             "worker's prefix) or stolen (left waiting in another's)",
                             ["queue"], registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prefill_prompt_tokens_total",
                                     "Prompt tokens of the jobs this worker prefilled "
                                     "(kind=prompt), and of them those found in its prefix "
                                     "cache (kind=cached)", ["kind"], registry=registry)
        self.compute = Histogram(f"{PREFIX}_prefill_compute_seconds",
                                 "Prompt KV computation per job", buckets=latency_buckets(),
                                 registry=registry)
        self.transfer = Histogram(f"{PREFIX}_prefill_transfer_seconds",
                                  "KV write into the decode worker per job",
                                  buckets=latency_buckets(), registry=registry)
        self.transfer_bytes = Counter(f"{PREFIX}_prefill_transfer_bytes_total",
                                      "KV bytes written to decode workers", registry=registry)

    def computed(self, seconds: float) -> None:
        """Called once per job whose prompt KV was computed here."""
        self.compute.observe(seconds)
        self.latency.bound_compute.observe(seconds)

    def transferred(self, seconds: float, nbytes: int) -> None:
        """Called once per job whose KV this worker wrote into a decode worker."""
        self.transfer.observe(seconds)
        self.latency.bound_transfer.observe(seconds)
        self.transfer_bytes.inc(nbytes)
