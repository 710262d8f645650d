"""Scorer ``round-robin``: a preference that rotates over the candidates on every call."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import RouteRequest, Snapshot, WorkerId, WorkerState

TYPE_NAME = "round-robin"
KIND = PluginKind.SCORER


class Params(StrictModel):
    """The ``round-robin`` scorer takes no parameters."""


class RoundRobinScorer:
    """Ranks candidates (sorted by worker id) starting from a position that advances by one
    on each call: the favourite scores 1.0, the next ``1 - 1/n``, and so on down to ``1/n``.

    Scoring the whole rotation (not just 1 for the favourite, 0 for the rest) lets it act
    as a gentle spreading term when mixed with other scorers.  With ``max-score`` alone it
    is plain round-robin.  Its counter is its only state, so one instance serves one profile.
    """

    def __init__(self, params: Params) -> None:
        self._calls = 0

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called per request; returns the rotating ranking and advances the rotation."""
        ids = sorted(w.worker_id for w in workers)
        n = len(ids)
        if n == 0:
            return {}
        start = self._calls % n
        self._calls += 1
        return {worker: 1.0 - ((i - start) % n) / n for i, worker in enumerate(ids)}
