"""Where observations come from: the supervisor's status, Prometheus scrapes, queue depth.

``MetricsSource.observe(now)`` is what the planner loop calls each interval.  It asks
the supervisor (``GET /v1/status``) which replicas exist and where their metrics are,
scrapes every ready worker and the frontend (its endpoint + ``/metrics``), reads the
JetStream prefill-queue depth, and builds an ``Observation`` with ``build_observation``
(pure, so tests check the arithmetic without sockets).  Counters become rates by
differencing against the previous scrape, which the source keeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.contracts import prometheus
from splitserve.contracts.metrics import PREFIX

from .connectors.base import DEFAULT_COMPONENTS
from .model import Observation, PoolObservation

# States in which a replica counts towards its pool (it is, or will be, serving).
LIVE_STATES = frozenset({"pending", "starting", "loading", "ready", "restarting"})
F = f"{PREFIX}_frontend_"
FRONTEND_SERIES = {"requests": F + "requests_total", "prompt_tokens": F + "prompt_tokens_total",
                   "output_tokens": F + "output_tokens_total",
                   "ttft_sum": F + "ttft_seconds_sum", "ttft_count": F + "ttft_seconds_count",
                   "itl_sum": F + "itl_seconds_sum", "itl_count": F + "itl_seconds_count"}


def parse_metrics(text: str, **labels: str) -> dict[str, float]:
    """Sum every sample of a Prometheus text exposition by sample name (labels dropped);
    with ``labels``, only the samples that carry them (a frontend serving several
    models: ``base_model="qwen3"``, which counts that model's adapters too)."""
    samples = prometheus.parse(text)
    if not labels:
        return prometheus.totals(samples)
    return {name: prometheus.value(samples, name, **labels) for name in samples}


@dataclass(frozen=True)
class FrontendTotals:
    """The frontend's counters at one scrape; two of them make the interval's rates."""

    time_s: float
    values: Mapping[str, float]


def _pool(rows: list[dict], component: str, scrapes: Mapping[str, Mapping[str, float]],
          gpu_metric: str | None, extra_waiting: float | None = None) -> PoolObservation:
    live = [r for r in rows if r.get("component") == component and r.get("state") in LIVE_STATES]
    ready = [r for r in live if r.get("state") == "ready"]
    seen = [scrapes[r["metrics"]] for r in ready if r.get("metrics") in scrapes]
    waiting = [s[f"{PREFIX}_worker_waiting_requests"] for s in seen
               if f"{PREFIX}_worker_waiting_requests" in s]
    kv = [s[f"{PREFIX}_worker_kv_usage_ratio"] * 100 for s in seen
          if f"{PREFIX}_worker_kv_usage_ratio" in s]
    gpu = [s[gpu_metric] for s in seen if gpu_metric and gpu_metric in s]
    queue = None
    if waiting or extra_waiting is not None:
        # Per ready replica: a worker's own queue averaged over the workers scraped (a
        # failed scrape is not read as an empty queue), plus the shared queue's share.
        own = sum(waiting) / len(waiting) if waiting else 0.0
        queue = own + (extra_waiting or 0.0) / max(len(ready), 1)
    return PoolObservation(
        replicas=len(live), ready=len(ready), queue_length=queue,
        gpu_utilization=sum(gpu) / len(gpu) if gpu else None,
        kv_cache_usage=sum(kv) / len(kv) if kv else None)


def _rate(now: FrontendTotals, prev: FrontendTotals | None, key: str) -> float | None:
    if prev is None or now.time_s <= prev.time_s:
        return None
    if FRONTEND_SERIES[key] not in now.values:
        return None
    delta = now.values[FRONTEND_SERIES[key]] - prev.values.get(FRONTEND_SERIES[key], 0.0)
    return max(delta, 0.0) / (now.time_s - prev.time_s)  # a counter reset reads as 0


def _mean(now: FrontendTotals, prev: FrontendTotals | None, name: str) -> float | None:
    if prev is None:
        return None
    s, c = (FRONTEND_SERIES[f"{name}_sum"], FRONTEND_SERIES[f"{name}_count"])
    count = now.values.get(c, 0.0) - prev.values.get(c, 0.0)
    return (now.values.get(s, 0.0) - prev.values.get(s, 0.0)) / count if count > 0 else None


def build_observation(now: float, status: Mapping[str, Any],
                      scrapes: Mapping[str, Mapping[str, float]],
                      frontend: FrontendTotals | None, previous: FrontendTotals | None,
                      queue_depth: int | None, components: Mapping[str, str] =
                      DEFAULT_COMPONENTS, gpu_metric: str | None = None) -> Observation:
    """Turn one round of readings into an ``Observation`` (pure).

    ``status``: the supervisor's ``GET /v1/status`` body; ``scrapes``: parsed metrics by
    URL; ``queue_depth``: JetStream prefill-queue depth (waiting + in flight), counted as
    waiting work of the prefill pool.  Rates and mean latencies need ``previous``.
    """
    rows = list(status.get("replicas", []))
    pools = {pool: _pool(rows, comp, scrapes, gpu_metric,
                         queue_depth if pool == "prefill" else None)
             for pool, comp in components.items()}
    rate = (lambda k: _rate(frontend, previous, k)) if frontend else (lambda k: None)
    mean = (lambda k: _mean(frontend, previous, k)) if frontend else (lambda k: None)
    return Observation(time_s=now, prefill=pools.get("prefill"), decode=pools.get("decode"),
                       requests_per_s=rate("requests"),
                       prompt_tokens_per_s=rate("prompt_tokens"),
                       output_tokens_per_s=rate("output_tokens"),
                       ttft_s=mean("ttft"), itl_s=mean("itl"))


class MetricsSource:
    """Observes a graph run by a local supervisor; one per planner process.

    ``queue_depth``: a no-I/O reader of the prefill-queue depth, e.g. ``lambda:
    monitor.depth`` for a started ``PrefillQueue.depth_monitor()``.  ``gpu_metric``: the
    per-worker GPU utilisation series (percent), when the fleet exports one (e.g. DCGM's
    ``DCGM_FI_DEV_GPU_UTIL`` relabelled per worker); none of this project's CPU workers do.
    """

    def __init__(self, control_url: str, *, components: Mapping[str, str] =
                 DEFAULT_COMPONENTS, frontend: str = "Frontend",
                 queue_depth: Callable[[], int | None] | None = None,
                 gpu_metric: str | None = None, client: httpx.AsyncClient | None = None,
                 timeout_s: float = 5.0, control_token: str | None = None,
                 model: str | None = None) -> None:
        self.control_url = control_url.rstrip("/")
        # The supervisor's bearer token goes to the control endpoint only, not to scrapes.
        self._control_headers = ({"Authorization": f"Bearer {control_token}"}
                                 if control_token else {})
        self.components = dict(components)
        self.frontend = frontend
        # A frontend serving several models: only the requests this pool's workers serve
        # count, its model's and its LoRA adapters' (labelled with it as base_model).
        self.frontend_labels = {"base_model": model} if model else {}
        self.queue_depth = queue_depth
        self.gpu_metric = gpu_metric
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._previous: FrontendTotals | None = None
        self.scrape_errors = 0

    async def _scrape(self, url: str, **labels: str) -> tuple[str, dict[str, float] | None]:
        try:
            reply = await self._client.get(url)
            reply.raise_for_status()
            return url, parse_metrics(reply.text, **labels)
        except (httpx.HTTPError, ValueError):
            self.scrape_errors += 1  # a replica going away mid-scrape is routine
            return url, None

    async def observe(self, now: float) -> Observation:
        """One round of readings; ``now`` is the caller's clock (monotonic seconds)."""
        reply = await self._client.get(f"{self.control_url}/v1/status",
                                       headers=self._control_headers)
        reply.raise_for_status()
        status = reply.json()
        rows = status.get("replicas", [])
        urls = [r["metrics"] for r in rows if r.get("state") == "ready" and r.get("metrics")
                and r.get("component") in self.components.values()]
        front = next((r for r in rows if r.get("component") == self.frontend
                      and r.get("state") == "ready" and r.get("endpoint")), None)
        front_url = front["endpoint"].rstrip("/") + "/metrics" if front else None
        fronts = [self._scrape(front_url, **self.frontend_labels)] if front_url else []
        results = dict(await asyncio.gather(*(self._scrape(u) for u in urls), *fronts))
        scrapes = {u: v for u, v in results.items() if v is not None}
        totals = None
        if front_url and front_url in scrapes:
            totals = FrontendTotals(now, scrapes.pop(front_url))
        obs = build_observation(now, status, scrapes, totals, self._previous,
                                self.queue_depth() if self.queue_depth else None,
                                self.components, self.gpu_metric)
        self._previous = totals or self._previous
        return obs

    async def close(self) -> None:
        """Close the HTTP client if this source made it."""
        if self._owns_client:
            await self._client.aclose()
