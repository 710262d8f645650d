"""Filter ``lora-loaded``: a request for a LoRA adapter goes only to workers that report
it loaded.

A worker without the adapter would refuse the request (its engine has not loaded it),
so this filter never waives itself: when no worker has the adapter, the request is
refused cleanly (the router answers ``lora-not-loaded``) instead of failing on a worker.
Requests for the base model pass untouched.  A profile without this filter gets it
anyway, ahead of its own filters (``core.Router.route``): no router config can send an
adapter request to a worker that cannot serve it.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.contracts.models import StrictModel

from ..protocols import FilterResult, PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "lora-loaded"
KIND = PluginKind.FILTER


class Params(StrictModel):
    """The ``lora-loaded`` filter takes no parameters."""


class LoraLoadedFilter:
    """Keeps the workers whose load reports list the request's adapter."""

    def __init__(self, params: Params) -> None:
        pass

    def filter(self, request: RouteRequest, snapshot: Snapshot,
               workers: Sequence[WorkerState]) -> FilterResult:
        """Called per request; returns every worker for a base-model request, else those
        that report ``request.lora`` loaded."""
        if request.lora is None:
            return FilterResult(list(workers), {})
        kept = [w for w in workers if request.lora in w.loras]
        removed: dict[WorkerId, str] = {
            w.worker_id: f"adapter '{request.lora}' not loaded" for w in workers
            if request.lora not in w.loras}
        return FilterResult(kept, removed)
