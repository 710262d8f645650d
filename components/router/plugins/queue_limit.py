"""Filter ``queue-limit``: drops workers whose waiting queue is full."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import FilterResult, PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "queue-limit"
KIND = PluginKind.FILTER


class Params(StrictModel):
    """Parameters of the ``queue-limit`` filter."""

    max_waiting_requests: int = Field(
        default=32, ge=1,
        description="Workers with at least this many waiting (not yet started) requests "
        "are dropped.")


class QueueLimitFilter:
    """A hard cap on queueing: a request behind a full queue would miss its TTFT anyway.

    If every worker is full nobody survives and the decision says 'all-filtered', which the
    router process turns into a 503 with Retry-After.
    """

    def __init__(self, params: Params) -> None:
        self._limit = params.max_waiting_requests

    def filter(self, request: RouteRequest, snapshot: Snapshot,
               workers: Sequence[WorkerState]) -> FilterResult:
        """Called per request; returns workers whose waiting queue is below the cap."""
        kept: list[WorkerState] = []
        removed: dict[WorkerId, str] = {}
        for worker in workers:
            if worker.waiting_requests >= self._limit:
                removed[worker.worker_id] = (
                    f"{worker.waiting_requests} waiting >= {self._limit}")
            else:
                kept.append(worker)
        return FilterResult(kept, removed)
