"""Turning a cost (lower is better) into a score in [0, 1] across the candidate set."""

from __future__ import annotations

from collections.abc import Mapping

from ..types import WorkerId


def invert_min_max(costs: Mapping[WorkerId, float]) -> dict[WorkerId, float]:
    """Return ``(max - cost) / (max - min)`` per worker: cheapest 1.0, dearest 0.0.

    Called by scorers whose natural output is a cost.  When all costs are equal every
    worker gets 1.0: nobody is worse than another, and a scorer that cannot tell workers
    apart should not shift the profile's totals relative to the others.  The scale is
    relative to the candidates, so a tiny difference still spans [0, 1]; the profile's
    weight is what says how much this scorer matters.
    """
    if not costs:
        return {}
    low, high = min(costs.values()), max(costs.values())
    if high == low:
        return {worker: 1.0 for worker in costs}
    span = high - low
    return {worker: (high - cost) / span for worker, cost in costs.items()}
