"""Scorer ``least-requests``: fewer running plus waiting requests is better."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState
from .normalise import invert_min_max

TYPE_NAME = "least-requests"
KIND = PluginKind.SCORER


class Params(StrictModel):
    """The ``least-requests`` scorer takes no parameters."""


class LeastRequestsScorer:
    """Scores ``active + waiting`` by min-max over the candidates: least loaded 1.0, most
    loaded 0.0, all equal 1.0.
    """

    def __init__(self, params: Params) -> None:
        pass

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called per request; returns each candidate's relative lightness of load."""
        return invert_min_max({w.worker_id: float(w.load) for w in workers})
