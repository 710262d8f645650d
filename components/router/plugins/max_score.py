"""Picker ``max-score``: the candidate with the highest total score."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from splitserve.contracts.models import StrictModel

from ..protocols import PluginKind
from ..types import WorkerId

TYPE_NAME = "max-score"
KIND = PluginKind.PICKER


class Params(StrictModel):
    """Parameters of the ``max-score`` picker."""

    tie_break: Literal["random", "lowest-id"] = Field(
        default="random",
        description="Among equal best scores: 'random' draws from a RNG seeded with `seed` "
        "(spreads load when scorers cannot tell workers apart), 'lowest-id' takes the "
        "smallest worker id (fully reproducible, but piles ties onto one worker).")
    seed: int = Field(default=0, description="Seed of the tie-breaking RNG.")


class MaxScorePicker:
    """Returns the best-scored worker; ties are broken as ``tie_break`` says.

    With 'random' the tied ids are sorted before drawing, so the same seed and the same
    sequence of inputs always give the same picks, whatever the dict order.
    """

    def __init__(self, params: Params) -> None:
        self._tie_break = params.tie_break
        self._rng = random.Random(params.seed)

    def pick(self, scored: Mapping[WorkerId, float]) -> WorkerId:
        """Called per request with the profile's totals; returns the chosen worker id."""
        best = max(scored.values())
        tied = sorted(worker for worker, total in scored.items() if total == best)
        if len(tied) == 1 or self._tie_break == "lowest-id":
            return tied[0]
        return self._rng.choice(tied)
