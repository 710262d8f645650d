"""Latency by pool: the workers' own TTFT, ITL and prefill stages, labelled by pool and
model (names in docs/metrics.md, "Latency by pool").

``pool`` is the component as `dynamo status` names it (``DecodeWorker``,
``Worker@qwen``: the graph's component, ``@`` and the ``Models`` pool for a pool's
copy), ``model`` the pool's served model name (requests for a LoRA adapter count
under the model that serves them).  Both are fixed for a worker process, so the
labelled children are bound once, when the worker starts; a request then only reads
the clock and observes (no label lookup per token).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Histogram

from splitserve.contracts.metrics import PREFIX, latency_buckets

POOL_LABELS = ("pool", "model")

TTFT = f"{PREFIX}_pool_ttft_seconds"
ITL = f"{PREFIX}_pool_itl_seconds"
QUEUE_WAIT = f"{PREFIX}_pool_prefill_queue_wait_seconds"
COMPUTE = f"{PREFIX}_pool_prefill_compute_seconds"
TRANSFER = f"{PREFIX}_pool_kv_transfer_seconds"


def pool_label(component: str, pool: str | None) -> str:
    """The ``pool`` label of a replica of ``component`` serving model pool ``pool``
    (None: the graph's first model): the name its status row shows."""
    return f"{component}@{pool}" if pool else component


def worker_labels(run) -> tuple[str, str]:
    """(pool, model) of the replica a ``ComponentRunConfig`` describes; called once by
    each worker shell when it builds its metrics."""
    return pool_label(run.component, run.pool), run.common.served_model_name


def _histogram(name: str, doc: str, registry) -> Histogram:
    return Histogram(name, doc, POOL_LABELS, buckets=latency_buckets(), registry=registry)


class TokenClock:
    """One request's first-token and inter-token times on this worker.

    Made by ``TokenLatency.clock`` when the request arrives; ``tokens(n)`` is called
    with each engine delta's token count.  The first delta with tokens observes TTFT
    (unless the request continues output begun on another worker: then that delta only
    starts the inter-token clock); each later one observes the gap since the previous
    delta divided by its tokens (one observation per delta, as the frontend counts ITL).
    """

    __slots__ = ("_itl", "_last", "_now", "_start", "_ttft", "_ttft_due")

    def __init__(self, ttft, itl, now: Callable[[], float], first_token: bool) -> None:
        self._ttft, self._itl, self._now = ttft, itl, now
        self._start = now()
        self._ttft_due = first_token
        self._last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = self._now()
        if self._last is not None:
            self._itl.observe((now - self._last) / n)
        elif self._ttft_due:
            self._ttft.observe(now - self._start)
        self._last = now


class TokenLatency:
    """TTFT and ITL of a decode or aggregated worker, bound to its pool and model."""

    def __init__(self, registry, pool: str, model: str,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.ttft = _histogram(TTFT, "Time to first token on the worker, from the "
                               "request's arrival there, by pool and model", registry)
        self.itl = _histogram(ITL, "Inter-token latency on the worker (per token, "
                              "between engine deltas), by pool and model", registry)
        self._ttft, self._itl = self.ttft.labels(pool, model), self.itl.labels(pool, model)
        self._now = now

    def clock(self, *, first_token: bool = True) -> TokenClock:
        """The clock of a request that arrived now; ``first_token=False`` for one that
        continues output begun on another worker (a live KV move): no TTFT here."""
        return TokenClock(self._ttft, self._itl, self._now, first_token)


class PrefillLatency:
    """A prefill worker's queue wait, compute and KV transfer, bound to its pool and
    model."""

    def __init__(self, registry, pool: str, model: str) -> None:
        self.queue_wait = _histogram(QUEUE_WAIT, "From a prefill job's enqueue to a prefill "
                                     "worker picking it up, by pool and model", registry)
        self.compute = _histogram(COMPUTE, "Prompt KV computation per prefill job, by pool "
                                  "and model", registry)
        self.transfer = _histogram(TRANSFER, "KV write into the decode worker per prefill "
                                   "job, by pool and model", registry)
        self.bound_queue_wait = self.queue_wait.labels(pool, model)
        self.bound_compute = self.compute.labels(pool, model)
        self.bound_transfer = self.transfer.labels(pool, model)

    def picked_up(self, enqueued_at: float, now: float | None = None) -> None:
        """Called when a delivery of a job starts here; ``enqueued_at`` is the job's
        wall-clock enqueue time (the decode worker's clock: a negative gap from clock
        skew between hosts counts as 0)."""
        now = time.time() if now is None else now
        self.bound_queue_wait.observe(max(0.0, now - enqueued_at))
