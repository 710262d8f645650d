"""Filter ``healthy``: drops workers that are unhealthy, draining or not heard from lately."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import FilterResult, PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "healthy"
KIND = PluginKind.FILTER


class Params(StrictModel):
    """Parameters of the ``healthy`` filter."""

    max_age_s: float = Field(
        default=10.0, gt=0.0,
        description="A worker whose last metrics report is older than this many seconds is "
        "treated as gone (its lease may not have expired yet).")


class HealthyFilter:
    """Keeps only workers that can take a request now.

    Unlike ``kv-headroom`` this filter never waives itself when it removes everyone: sending
    a request to a dead or draining worker only turns a clean rejection into a failure.
    """

    def __init__(self, params: Params) -> None:
        self._max_age_s = params.max_age_s

    def filter(self, request: RouteRequest, snapshot: Snapshot,
               workers: Sequence[WorkerState]) -> FilterResult:
        """Called per request; returns the workers that are healthy, live and not draining."""
        kept: list[WorkerState] = []
        removed: dict[WorkerId, str] = {}
        for worker in workers:
            if not worker.healthy:
                removed[worker.worker_id] = "unhealthy"
            elif worker.draining:
                removed[worker.worker_id] = "draining"
            elif worker.last_seen_s > self._max_age_s:
                removed[worker.worker_id] = (
                    f"stale: last seen {worker.last_seen_s:.1f}s ago > {self._max_age_s:g}s")
            else:
                kept.append(worker)
        return FilterResult(kept, removed)
