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


def cache_credit(snapshot: Snapshot, worker_id: WorkerId) -> float:
    """The prompt blocks ``worker_id`` would not compute, each credited by the KV tier
    holding it: a pool (device) block 1.0, a host or disk block the router's
    ``host_cache_hit_weight`` / ``disk_cache_hit_weight`` (``weighted_overlap_blocks``);
    the pool's count alone where the snapshot has no weighted figure."""
    return max(snapshot.weighted_overlap_blocks.get(worker_id, 0.0),
               float(snapshot.overlap_blocks.get(worker_id, 0)))


class KvOverlapScorer:
    """Scores ``cache_credit(worker) / request.num_blocks`` from the prefix index: the
    fraction of the prompt cached, a block in a lower KV tier credited by its weight.

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
            w.worker_id: min(1.0, cache_credit(snapshot, w.worker_id) / request.num_blocks)
            for w in workers
        }
