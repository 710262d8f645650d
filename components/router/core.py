"""The router core: ``Router.route(request, snapshot) -> Decision``, with no I/O.

A ``SchedulingProfile`` runs its filters in config order, every scorer on the survivors,
and its picker on the totals.  The profile, not the plugins, owns the arithmetic: each raw
score is clamped to [0, 1] (NaN counts as 0), multiplied by the scorer's weight, optionally
divided by the sum of the weights, and summed per worker.  Every plugin call is timed with
``time.perf_counter_ns`` so the router process can export per-plugin latency without the
plugins knowing about metrics.  The same core serves the live router, replays, tests and
``dynamo route explain``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .config import DEFAULT_WEIGHT, RouterConfig, check_router_config
from .plugins.lora_loaded import TYPE_NAME as LORA_FILTER
from .plugins.lora_loaded import LoraLoadedFilter
from .plugins.lora_loaded import Params as LoraParams
from .protocols import Filter, Picker, PluginKind, Scorer
from .registry import PluginRegistry
from .seed_policy import (
    SEED_NOTE,
    SPLIT_SCORER,
    SeedRouting,
    SplitPolicyScorer,
    adjust_snapshot,
)
from .types import (
    Decision,
    FilterRemoval,
    RouteRequest,
    ScorerBreakdown,
    Snapshot,
    WorkerId,
    WorkerState,
)


@dataclass(frozen=True)
class NamedFilter:
    """A filter with its config name."""

    name: str
    plugin: Filter


@dataclass(frozen=True)
class WeightedScorer:
    """A scorer with its config name and the profile's weight for it (>= 0)."""

    name: str
    plugin: Scorer
    weight: float = DEFAULT_WEIGHT


@dataclass(frozen=True)
class NamedPicker:
    """A picker with its config name."""

    name: str
    plugin: Picker


def clamp_score(value: float) -> float:
    """Return ``value`` limited to [0, 1]; NaN becomes 0 so one bad scorer cannot win."""
    if math.isnan(value):
        return 0.0
    return min(1.0, max(0.0, value))


class SchedulingProfile:
    """One filters -> scorers -> picker pipeline; ``run`` is called once per request."""

    def __init__(self, name: str, filters: Sequence[NamedFilter],
                 scorers: Sequence[WeightedScorer], picker: NamedPicker,
                 normalize_weights: bool = False) -> None:
        if any(s.weight < 0 for s in scorers):
            raise ValueError(f"profile {name!r}: scorer weights must be >= 0")
        self.name = name
        self._filters = tuple(filters)
        self.filters_adapters = any(isinstance(f.plugin, LoraLoadedFilter) for f in filters)
        """The profile has a ``lora-loaded`` filter of its own (else ``Router.route`` runs
        one ahead of its filters)."""
        self._scorers = tuple(scorers)
        self._picker = picker
        total = sum(s.weight for s in scorers)
        # Normalising by a zero total would divide by zero; all-zero weights sum to 0 anyway.
        self._divisor = total if normalize_weights and total > 0 else 1.0

    def _filter(self, request: RouteRequest, snapshot: Snapshot, elapsed: dict[str, int],
                removed: list[FilterRemoval], notes: dict[str, str]) -> list[WorkerState]:
        candidates = list(snapshot.workers)
        for named in self._filters:
            start = time.perf_counter_ns()
            result = named.plugin.filter(request, snapshot, candidates)
            elapsed[named.name] = time.perf_counter_ns() - start
            removed.extend(FilterRemoval(plugin=named.name, worker_id=worker, reason=reason)
                           for worker, reason in result.removed.items())
            if result.note:
                notes[named.name] = result.note
            candidates = list(result.kept)
            if not candidates:
                break
        return candidates

    def run(self, request: RouteRequest, snapshot: Snapshot,
            extra_scorers: Sequence[WeightedScorer] = (),
            pre_removed: Sequence[FilterRemoval] = (),
            notes: dict[str, str] | None = None) -> Decision:
        """Place ``request``; returns the decision, with worker_id None if nobody survived.

        ``extra_scorers`` run after the profile's own (the policy's ``split_policy``);
        ``pre_removed`` and ``notes`` carry what the policy did before the profile ran.
        """
        elapsed: dict[str, int] = {}
        removed: list[FilterRemoval] = list(pre_removed)
        notes = dict(notes or {})
        candidates = self._filter(request, snapshot, elapsed, removed, notes)
        if not candidates:
            return Decision(request_id=request.request_id, lora=request.lora,
                            profile=self.name, worker_id=None,
                            reason="no-workers" if not snapshot.workers else "all-filtered",
                            candidates=(), totals={}, removed=tuple(removed), notes=notes,
                            elapsed_ns=elapsed)
        ids = [w.worker_id for w in candidates]
        totals: dict[WorkerId, float] = dict.fromkeys(ids, 0.0)
        breakdowns: list[ScorerBreakdown] = []
        scorers = self._scorers + tuple(extra_scorers)
        divisor = self._divisor
        if extra_scorers and self._divisor != 1.0:
            divisor = sum(s.weight for s in scorers) or 1.0
        for named in scorers:
            start = time.perf_counter_ns()
            scores = named.plugin.score(request, snapshot, candidates)
            elapsed[named.name] = time.perf_counter_ns() - start
            raw = {w: clamp_score(float(scores.get(w, 0.0))) for w in ids}
            weighted = {w: raw[w] * named.weight / divisor for w in ids}
            for w in ids:
                totals[w] += weighted[w]
            breakdowns.append(ScorerBreakdown(plugin=named.name, weight=named.weight,
                                              raw=raw, weighted=weighted))
        start = time.perf_counter_ns()
        chosen = self._picker.plugin.pick(totals)
        elapsed[self._picker.name] = time.perf_counter_ns() - start
        if chosen not in totals:
            raise ValueError(f"picker {self._picker.name!r} returned {chosen!r}, "
                             "which is not a candidate")
        return Decision(request_id=request.request_id, lora=request.lora, profile=self.name,
                        worker_id=chosen,
                        reason="picked", candidates=tuple(ids), totals=totals,
                        scorers=tuple(breakdowns), removed=tuple(removed), notes=notes,
                        elapsed_ns=elapsed)


class Router:
    """Holds the scheduling profiles; the router process calls ``route`` per request."""

    def __init__(self, profiles: Sequence[SchedulingProfile],
                 default_profile: str | None = None, seed: SeedRouting | None = None) -> None:
        if not profiles:
            raise ValueError("a router needs at least one scheduling profile")
        self._profiles = {p.name: p for p in profiles}
        if len(self._profiles) != len(profiles):
            raise ValueError("scheduling profile names must be unique")
        self._default = default_profile or profiles[0].name
        if self._default not in self._profiles:
            raise ValueError(f"unknown default profile {self._default!r}")
        self.seed = seed or SeedRouting()
        self._extra: tuple[WeightedScorer, ...] = ()
        if self.seed.split is not None:
            self._extra = (WeightedScorer(SPLIT_SCORER, SplitPolicyScorer(self.seed.split)),)

    def with_seed(self, seed: SeedRouting) -> Router:
        """A router with the same profiles (and plugin state) and the policy's routing
        sections; called when a policy version is applied."""
        return Router(list(self._profiles.values()), self._default, seed)

    @property
    def profile_names(self) -> list[str]:
        """Names of the profiles, in config order."""
        return list(self._profiles)

    def route(self, request: RouteRequest, snapshot: Snapshot,
              profile: str | None = None) -> Decision:
        """Choose a worker for ``request`` with ``profile`` (the default one if None).

        The policy's routing sections (``seed_policy``) adjust the snapshot first and add
        the ``split-policy`` scorer.  Returns the decision as data; raises KeyError for an
        unknown profile name.
        """
        chosen = self._profiles[profile or self._default]
        removed: list[FilterRemoval] = []
        if request.lora is not None and not chosen.filters_adapters:
            snapshot, removed = _adapter_holders(request, snapshot)
        if self.seed.neutral:
            return chosen.run(request, snapshot, pre_removed=removed)
        adjusted, hot = adjust_snapshot(request, snapshot, self.seed)
        removed += [FilterRemoval(plugin=SEED_NOTE, worker_id=w, reason=r)
                    for w, r in hot.items()]
        return chosen.run(request, adjusted, self._extra, removed,
                          {SEED_NOTE: self.seed.describe()})


_IMPLICIT_LORA = LoraLoadedFilter(LoraParams())


def _adapter_holders(request: RouteRequest, snapshot: Snapshot
                     ) -> tuple[Snapshot, list[FilterRemoval]]:
    """``snapshot`` narrowed to the workers that report the request's adapter loaded,
    for a profile without a ``lora-loaded`` filter; the others are listed as removed by
    it."""
    result = _IMPLICIT_LORA.filter(request, snapshot, snapshot.workers)
    removed = [FilterRemoval(plugin=LORA_FILTER, worker_id=w, reason=r)
               for w, r in result.removed.items()]
    return snapshot.model_copy(update={"workers": tuple(result.kept)}), removed


def build_router(config: RouterConfig, registry: PluginRegistry) -> Router:
    """Build a router from a config; called once at start-up and on each config reload.

    Every plugin instance is built once and shared by the profiles that reference it, so a
    stateful plugin (round-robin) keeps one rotation.  Raises ``ValidationError`` with
    field paths if the config does not check out against ``registry``.
    """
    params = check_router_config(config, registry)
    instances = {}
    kinds = {}
    for spec in config.plugins:
        plugin_type = registry.get(spec.type)
        assert plugin_type is not None  # check_router_config rejected unknown types
        instances[spec.name] = plugin_type.factory(params[spec.name])
        kinds[spec.name] = plugin_type.kind
    profiles = []
    for spec in config.scheduling_profiles:
        filters, scorers, pickers = [], [], []
        for ref in spec.plugins:
            name, kind = ref.plugin_ref, kinds[ref.plugin_ref]
            if kind is PluginKind.FILTER:
                filters.append(NamedFilter(name, instances[name]))
            elif kind is PluginKind.SCORER:
                weight = DEFAULT_WEIGHT if ref.weight is None else ref.weight
                scorers.append(WeightedScorer(name, instances[name], weight))
            else:
                pickers.append(NamedPicker(name, instances[name]))
        profiles.append(SchedulingProfile(spec.name, filters, scorers, pickers[0],
                                          spec.normalize_weights))
    return Router(profiles, config.default_profile)
