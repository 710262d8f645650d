"""Picker ``weighted-random``: draws a worker with probability proportional to its score."""

from __future__ import annotations

import random
from collections.abc import Mapping

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import WorkerId

TYPE_NAME = "weighted-random"
KIND = PluginKind.PICKER


class Params(StrictModel):
    """Parameters of the ``weighted-random`` picker."""

    seed: int = Field(default=0, description="Seed of the RNG, for reproducible runs.")


class WeightedRandomPicker:
    """Spreads load in proportion to the scores instead of always taking the best.

    Workers are considered in id order so a seed reproduces the same picks.  When every
    score is 0 the draw is uniform: all candidates passed the filters, so all are allowed.
    """

    def __init__(self, params: Params) -> None:
        self._rng = random.Random(params.seed)

    def pick(self, scored: Mapping[WorkerId, float]) -> WorkerId:
        """Called per request with the profile's totals; returns the drawn worker id."""
        ids = sorted(scored)
        weights = [max(0.0, scored[worker]) for worker in ids]
        if sum(weights) <= 0.0:
            return self._rng.choice(ids)
        return self._rng.choices(ids, weights=weights, k=1)[0]
