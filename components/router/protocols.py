"""The three extension points of a scheduling profile: filter, scorer, picker.

A profile runs its filters in order, then every scorer on the survivors, then one picker.
Plugins see neither their weights nor each other: the profile clamps, weighs and sums
scores, and times every call, so a plugin is a small pure-ish class that is easy to test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple, Protocol, runtime_checkable

from .types import RouteRequest, Snapshot, WorkerId, WorkerState


class PluginKind(StrEnum):
    """Which extension point a plugin type implements."""

    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"


class FilterResult(NamedTuple):
    """What a filter returns: survivors, removed workers with reasons, and an optional note.

    ``note`` carries a remark that removed nobody, e.g. that a limit was waived because
    every worker exceeded it; the profile records it in the decision.
    """

    kept: list[WorkerState]
    removed: dict[WorkerId, str]
    note: str = ""


@runtime_checkable
class Filter(Protocol):
    """Drops workers that must not receive the request."""

    def filter(self, request: RouteRequest, snapshot: Snapshot,
               workers: Sequence[WorkerState]) -> FilterResult:
        """Called once per request with the current candidates; returns who stays."""
        ...


@runtime_checkable
class Scorer(Protocol):
    """Rates candidates; higher is better."""

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called once per request with the filtered candidates (never empty).

        Returns a score in [0, 1] per candidate; the profile clamps anything outside and
        treats a missing worker as 0.
        """
        ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one worker from the profile's total scores."""

    def pick(self, scored: Mapping[WorkerId, float]) -> WorkerId:
        """Called once per request with a non-empty map; returns one of its keys."""
        ...
