"""The plugin registry: kebab-case type name -> (kind, params model, factory).

A registry is an ordinary object.  ``default_registry()`` returns a fresh one holding the
built-ins; a deployment that adds its own plugins builds one, registers into it and passes
it to the config loader and ``build_router``.  Nothing is registered at import time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from .plugins import (
    healthy,
    kv_headroom,
    kv_overlap,
    latency_cost,
    least_requests,
    lora_loaded,
    max_score,
    queue_limit,
    round_robin,
    weighted_random,
)
from .protocols import Filter, Picker, PluginKind, Scorer

Plugin = Filter | Scorer | Picker
_KEBAB = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class PluginType:
    """How to build one plugin type: which extension point, its params model, its factory."""

    name: str
    kind: PluginKind
    params_model: type[BaseModel]
    factory: Callable[[Any], Plugin]


class PluginRegistry:
    """Maps plugin type names to ``PluginType``; read by the config checks and the builder."""

    def __init__(self) -> None:
        self._types: dict[str, PluginType] = {}

    def register(self, name: str, kind: PluginKind, params_model: type[BaseModel],
                 factory: Callable[[Any], Plugin]) -> None:
        """Add a type; called while assembling a registry, before any config is loaded.

        Raises ValueError for a name that is not kebab-case or is already taken, so two
        plugins can never silently shadow each other.
        """
        if not _KEBAB.match(name):
            raise ValueError(f"plugin type name {name!r} is not kebab-case")
        if name in self._types:
            raise ValueError(f"plugin type {name!r} is already registered")
        self._types[name] = PluginType(name, kind, params_model, factory)

    def get(self, name: str) -> PluginType | None:
        """Return the type registered as ``name``, or None."""
        return self._types.get(name)

    def names(self) -> list[str]:
        """Return the registered type names, sorted (for error messages and schemas)."""
        return sorted(self._types)

    def types(self) -> list[PluginType]:
        """Return every registered type, sorted by name."""
        return [self._types[name] for name in self.names()]


_BUILTINS: tuple[tuple[ModuleType, Callable[[Any], Plugin]], ...] = (
    (healthy, healthy.HealthyFilter),
    (kv_headroom, kv_headroom.KvHeadroomFilter),
    (lora_loaded, lora_loaded.LoraLoadedFilter),
    (queue_limit, queue_limit.QueueLimitFilter),
    (round_robin, round_robin.RoundRobinScorer),
    (least_requests, least_requests.LeastRequestsScorer),
    (kv_overlap, kv_overlap.KvOverlapScorer),
    (latency_cost, latency_cost.LatencyCostScorer),
    (max_score, max_score.MaxScorePicker),
    (weighted_random, weighted_random.WeightedRandomPicker),
)


def default_registry() -> PluginRegistry:
    """Return a new registry with the built-in filters, scorers and pickers."""
    registry = PluginRegistry()
    for module, factory in _BUILTINS:
        registry.register(module.TYPE_NAME, module.KIND, module.Params, factory)
    return registry
