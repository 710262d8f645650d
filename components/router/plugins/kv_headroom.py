"""Filter ``kv-headroom``: drops workers whose KV cache is nearly full."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import FilterResult, PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "kv-headroom"
KIND = PluginKind.FILTER


class Params(StrictModel):
    """Parameters of the ``kv-headroom`` filter."""

    max_kv_usage: float = Field(
        default=0.95, gt=0.0, le=1.0,
        description="Workers whose KV usage (used / total blocks) is above this fraction are "
        "dropped, unless every candidate is above it.")


class KvHeadroomFilter:
    """Avoids workers that would have to evict or preempt to fit the request.

    When every candidate is above the limit the filter keeps them all and says so in its
    note: the scorers can still pick the least bad one, and rejecting is the admission
    controller's call, not a side effect of a soft capacity hint.
    """

    def __init__(self, params: Params) -> None:
        self._limit = params.max_kv_usage

    def filter(self, request: RouteRequest, snapshot: Snapshot,
               workers: Sequence[WorkerState]) -> FilterResult:
        """Called per request; returns workers at or below the KV-usage limit."""
        kept: list[WorkerState] = []
        removed: dict[WorkerId, str] = {}
        for worker in workers:
            usage = worker.kv_usage
            if usage <= self._limit:
                kept.append(worker)
            else:
                removed[worker.worker_id] = f"KV usage {usage:.2f} > {self._limit:g}"
        if not kept and workers:
            return FilterResult(list(workers), {},
                                f"all {len(workers)} workers above KV usage "
                                f"{self._limit:g}; kept all")
        return FilterResult(kept, removed)
