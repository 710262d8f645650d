"""Scorer ``latency-cost``: the seed's linear latency cost, turned into a [0, 1] score.

Cost (lower is better), per candidate worker::

    cost = occupancy_weight     * occupancy_pct      (KV blocks used / total x 100, 0..100)
         + active_requests_weight * active_requests  (requests being decoded, a count)
         - cache_match_weight   * cache_match        (prompt blocks cached there, a count)
         + mem_bw_weight        * mem_bw_pct         (memory-bandwidth utilisation x 100)
         - recent_prefix_weight * recent_prefix      (prompt blocks recently routed there)

Defaults are the seed's coefficients: 3.0, 1.0, 10.0, 0.5, 1.0.

``cache_match`` is the number of cached prefix blocks (``kv_overlap.cache_credit``: a
block in a host or disk KV tier counts by the router's tier weight), not the fraction.  The cost stands for latency, and the prefill work a cache hit saves grows
with the number of blocks it skips: a fully cached 1-block prompt saves almost nothing, a
fully cached 500-block prompt saves a long prefill.  A count also shares its unit with
``recent_prefix`` (blocks), which the seed weighs at 1.0 next to cache_match's 10.0.  As a
fraction the term could move the cost by at most 10 while occupancy spans 300, so the
cache would barely ever matter.  With counts, long cached prompts dominate, which is the
point of KV-aware routing; lower ``cache_match_weight`` to temper it.

The cost is turned into a score by min-max over the candidates (cheapest 1.0, dearest 0.0,
all equal 1.0; see ``normalise.invert_min_max``) so that it composes with the other
scorers under the profile's weights.  The min-max keeps the order and relative spacing of
the costs but drops their absolute size: a 1-point gap and a 1000-point gap both span
[0, 1], so the profile weight alone sets how much this scorer matters.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState
from .kv_overlap import cache_credit
from .normalise import invert_min_max

TYPE_NAME = "latency-cost"
KIND = PluginKind.SCORER


class Params(StrictModel):
    """Coefficients of the latency cost; signs are fixed by the formula, so all are >= 0."""

    occupancy_weight: float = Field(default=3.0, ge=0.0,
                                    description="Cost per percentage point of KV occupancy.")
    active_requests_weight: float = Field(default=1.0, ge=0.0,
                                          description="Cost per active request.")
    cache_match_weight: float = Field(default=10.0, ge=0.0,
                                      description="Credit per prompt block already cached.")
    mem_bw_weight: float = Field(default=0.5, ge=0.0, description="Cost per percentage "
                                 "point of memory-bandwidth utilisation.")
    recent_prefix_weight: float = Field(default=1.0, ge=0.0, description="Credit per prompt "
                                        "block recently routed to the worker.")


def latency_cost(worker: WorkerState, cache_match: float, recent_prefix: int,
                 params: Params) -> float:
    """Return the seed's cost for one worker (lower is better); see the module docstring."""
    return (params.occupancy_weight * worker.kv_usage * 100.0
            + params.active_requests_weight * worker.active_requests
            - params.cache_match_weight * cache_match
            + params.mem_bw_weight * worker.mem_bw_util * 100.0
            - params.recent_prefix_weight * recent_prefix)


class LatencyCostScorer:
    """Scores candidates by the inverse min-max of their latency cost."""

    def __init__(self, params: Params) -> None:
        self._params = params

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called per request; returns 1.0 for the cheapest candidate, 0.0 for the dearest."""
        costs = {
            w.worker_id: latency_cost(w, cache_credit(snapshot, w.worker_id),
                                      snapshot.recent_prefix_blocks.get(w.worker_id, 0),
                                      self._params)
            for w in workers
        }
        return invert_min_max(costs)
