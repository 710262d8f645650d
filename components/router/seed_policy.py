"""The policy file's routing sections, applied by the router core on every decision.

The seed's policy file carries three sections about worker choice that are not plugin
configs: ``split_policy`` (weights of prefix reuse, queue and decode load),
``cache`` (``reuse_prefix``, ``min_cache_hit_ratio``) and ``enable_hotspot_prevention``.
``SeedRouting`` holds what a policy version set; ``Router.route`` applies it around the
scheduling profile, so every profile (built-in or custom) honours it:

- ``reuse_prefix: false``: the snapshot's KV overlap and recent-prefix counts are
  dropped, so no scorer can prefer a worker for holding the prefix.
- ``min_cache_hit_ratio`` r > 0: a worker's overlap counts only when it covers at least
  r of the prompt's blocks; below that the request is placed by load alone.
- ``enable_hotspot_prevention``: a worker whose load (active + waiting requests) exceeds
  ``HOTSPOT_FACTOR`` x the mean load of the other candidates + ``HOTSPOT_SLACK`` is
  removed from the candidates (never the last one), so a hot prefix cannot pile work on
  one worker however well its cache matches.
- ``split_policy``: one more scorer, ``split-policy``, with the linear cost
  ``queue_length_weight·waiting + decode_load_weight·active −
  prefix_cache_weight·cached_blocks`` (cached blocks counted only for prompts of at least
  ``prompt_length_threshold`` tokens: a shorter prompt's prefill is cheap, so its cache hit
  should not outweigh load), min-max inverted to [0, 1] and added with weight 1.

Pure: no clock, no I/O.  Sections a policy version leaves out keep their neutral defaults
(a section left out is not governed by policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .plugins.normalise import invert_min_max
from .types import RouteRequest, Snapshot, WorkerId, WorkerState

HOTSPOT_FACTOR = 2.0
HOTSPOT_SLACK = 2.0
SPLIT_SCORER = "split-policy"
SEED_NOTE = "seed-policy"


@dataclass(frozen=True)
class SplitWeights:
    """``split_policy`` as the router reads it."""

    prompt_length_threshold: int
    prefix_cache_weight: float
    queue_length_weight: float
    decode_load_weight: float


@dataclass(frozen=True)
class SeedRouting:
    """The routing sections of one policy version; the defaults change nothing."""

    reuse_prefix: bool = True
    min_cache_hit_ratio: float = 0.0
    hotspot_prevention: bool = False
    split: SplitWeights | None = None

    @classmethod
    def from_policy(cls, policy: Any) -> SeedRouting:
        """Read a ``PolicyFile``'s sections; called at start-up and on every policy apply."""
        cache = policy.cache
        split = policy.split_policy
        return cls(
            reuse_prefix=True if cache is None else cache.reuse_prefix,
            min_cache_hit_ratio=0.0 if cache is None else cache.min_cache_hit_ratio,
            hotspot_prevention=bool(policy.enable_hotspot_prevention),
            split=None if split is None else SplitWeights(**split.model_dump()))

    @property
    def neutral(self) -> bool:
        """True when applying this changes no decision."""
        return self == SeedRouting()

    def describe(self) -> str:
        """One line for decision notes and logs."""
        parts = [f"reuse_prefix={self.reuse_prefix}",
                 f"min_cache_hit_ratio={self.min_cache_hit_ratio:g}",
                 f"hotspot_prevention={self.hotspot_prevention}"]
        if self.split is not None:
            parts.append(f"split_policy={self.split}")
        return " ".join(parts)


def worker_load(worker: WorkerState) -> int:
    """The load hotspot prevention compares: requests decoding plus requests waiting."""
    return worker.active_requests + worker.waiting_requests


def hot_workers(workers: Sequence[WorkerState]) -> dict[WorkerId, str]:
    """Workers much busier than the rest, with the reason; never every worker."""
    if len(workers) < 2:
        return {}
    loads = {w.worker_id: worker_load(w) for w in workers}
    total = sum(loads.values())
    hot: dict[WorkerId, str] = {}
    for wid, load in loads.items():
        others = (total - load) / (len(loads) - 1)
        cap = HOTSPOT_FACTOR * others + HOTSPOT_SLACK
        if load > cap:
            hot[wid] = f"hotspot: load {load} > {HOTSPOT_FACTOR:g}x others' mean " \
                       f"{others:.1f} + {HOTSPOT_SLACK:g}"
    if len(hot) == len(loads):
        return {}
    return hot


def adjust_snapshot(request: RouteRequest, snapshot: Snapshot,
                    seed: SeedRouting) -> tuple[Snapshot, dict[WorkerId, str]]:
    """Apply the cache and hotspot sections; returns the snapshot the profile sees and the
    workers removed as hotspots (with reasons)."""
    overlap = dict(snapshot.overlap_blocks)
    recent = dict(snapshot.recent_prefix_blocks)
    tiers, weighted = dict(snapshot.tier_overlap_blocks), dict(snapshot.weighted_overlap_blocks)
    if not seed.reuse_prefix:
        overlap, recent, tiers, weighted = {}, {}, {}, {}
    elif seed.min_cache_hit_ratio > 0:
        blocks = max(1, request.num_blocks)
        overlap = {w: n for w, n in overlap.items() if n / blocks >= seed.min_cache_hit_ratio}
        recent = {w: n for w, n in recent.items() if n / blocks >= seed.min_cache_hit_ratio}
        weighted = {w: x for w, x in weighted.items() if x / blocks >= seed.min_cache_hit_ratio}
    workers = snapshot.workers
    hot: dict[WorkerId, str] = {}
    if seed.hotspot_prevention:
        hot = hot_workers([w for w in workers if w.healthy and not w.draining])
        workers = tuple(w for w in workers if w.worker_id not in hot)
    return Snapshot(workers=workers, overlap_blocks=overlap, recent_prefix_blocks=recent,
                    tier_overlap_blocks=tiers, weighted_overlap_blocks=weighted), hot


class SplitPolicyScorer:
    """The ``split_policy`` cost as a scorer (see the module docstring)."""

    def __init__(self, weights: SplitWeights) -> None:
        self._w = weights

    def score(self, request: RouteRequest, snapshot: Snapshot,
              workers: Sequence[WorkerState]) -> dict[WorkerId, float]:
        """Called per request by the profile; cheapest candidate 1.0, dearest 0.0."""
        w = self._w
        long_prompt = request.num_tokens >= w.prompt_length_threshold
        costs = {}
        for worker in workers:
            cached = snapshot.overlap_blocks.get(worker.worker_id, 0) if long_prompt else 0
            costs[worker.worker_id] = (w.queue_length_weight * worker.waiting_requests
                                       + w.decode_load_weight * worker.active_requests
                                       - w.prefix_cache_weight * cached)
        return invert_min_max(costs)
