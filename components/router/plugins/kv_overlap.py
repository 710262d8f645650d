"""Scorer ``kv-overlap``: the fraction of the request's prompt blocks a worker already caches."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "kv-overlap"
KIND = PluginKind.SCORER


class Params(StrictModel):
    """The ``kv-overlap`` scorer takes no parameters."""


class KvOverlapScorer:
    """Scores ``overlap_blocks[worker] / request.num_blocks`` from the prefix index.

    An absolute fraction (not relative to the other candidates): half the prompt cached is
    0.5 whoever else caches what, so the score means the same thing across requests.  A
    request with no blocks scores 0 everywhere: there is nothing to reuse.
    """

    def __init__(self, params: Params) -> None:
        pass

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called per request; returns the cached fraction of the prompt per candidate."""
        if request.num_blocks == 0:
            return {w.worker_id: 0.0 for w in workers}
        return {
            w.worker_id: min(1.0, snapshot.overlap_blocks.get(w.worker_id, 0) / request.num_blocks)
            for w in workers
        }
