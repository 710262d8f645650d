"""Routing, cache and autoscaling sections of the policy file (the seed's shapes).

Read by the router (``split_policy``, ``cache``, ``enable_hotspot_prevention``: applied on
every decision by ``components/router/seed_policy.py``, see docs/policies.md) and the
planner (``autoscale``).  Percentages are written as the seed writes them: 0..100.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails

from .base import PolicyModel, check, problem


class SplitPolicy(PolicyModel):
    """How the router weighs prefix reuse, queueing and decode load when splitting work.

    The router adds a ``split-policy`` scorer with the cost ``queue_length_weight x waiting
    + decode_load_weight x active - prefix_cache_weight x cached blocks``.
    """

    prompt_length_threshold: int = Field(
        ge=0, description="Prompt tokens from which a cached prefix counts in the worker "
                          "score; a shorter prompt's prefill is cheap, so it goes by load.")
    prefix_cache_weight: float = Field(
        ge=0.0, description="Weight of the cached-prefix match in the worker score.")
    queue_length_weight: float = Field(
        ge=0.0, description="Weight of the worker's waiting queue in the worker score.")
    decode_load_weight: float = Field(
        ge=0.0, description="Weight of the worker's active decode requests in the score.")


class CachePolicy(PolicyModel):
    """Prefix-cache reuse."""

    reuse_prefix: bool = Field(description="Route requests sharing a prefix to the worker "
                                           "that holds it.")
    min_cache_hit_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Fraction (0..1) of the prompt that must be cached on a worker for the "
                    "cache to outweigh load when picking it.")


class ScaleThresholds(PolicyModel):
    """Signals that trigger a scaling step; at least one must be set."""

    queue_length: float | None = Field(
        default=None, ge=0.0, description="Requests waiting per replica.")
    gpu_utilization: float | None = Field(
        default=None, ge=0.0, le=100.0, description="GPU utilisation, percent (0..100).")
    kv_cache_usage: float | None = Field(
        default=None, ge=0.0, le=100.0, description="KV-cache blocks in use, percent (0..100).")

    def signals(self) -> dict[str, float]:
        """Return the thresholds that are set, by name; used by checks and the planner."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    @model_validator(mode="after")
    def _some_signal(self) -> Self:
        if not self.signals():
            check([problem((), "set at least one of queue_length, gpu_utilization, "
                               "kv_cache_usage", {})])
        return self


class PoolAutoscale(PolicyModel):
    """Replica bounds and hysteresis thresholds of one pool (prefill or decode)."""

    min_replicas: int = Field(ge=0, description="Fewest replicas the planner keeps.")
    max_replicas: int = Field(ge=1, description="Most replicas the planner starts.")
    scale_up: ScaleThresholds = Field(description="Add a replica when any signal is at or "
                                                  "above its threshold.")
    scale_down: ScaleThresholds = Field(description="Remove a replica when every signal is "
                                                    "at or below its threshold.")

    @model_validator(mode="after")
    def _bounds_and_hysteresis(self) -> Self:
        lines: list[InitErrorDetails] = []
        if self.min_replicas > self.max_replicas:
            lines.append(problem(("min_replicas",), f"min_replicas ({self.min_replicas}) must "
                                 f"not exceed max_replicas ({self.max_replicas})",
                                 self.min_replicas))
        up = self.scale_up.signals()
        for name, down in self.scale_down.signals().items():
            # Equal thresholds would scale up and down on the same reading: flapping.
            if name in up and down >= up[name]:
                lines.append(problem(("scale_down", name), f"scale_down.{name} ({down:g}) must "
                                     f"be below scale_up.{name} ({up[name]:g})", down))
        check(lines)
        return self


class Autoscale(PolicyModel):
    """Planner bounds per pool; a pool left out is not scaled by policy."""

    prefill: PoolAutoscale | None = Field(default=None, description="The prefill pool.")
    decode: PoolAutoscale | None = Field(default=None, description="The decode pool.")
