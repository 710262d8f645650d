"""Router configs shipped with the distribution, as data.

Kept as Python constants so they work from an installed wheel; ``schema.export_router_configs``
writes them to ``configs/router/<name>.yaml`` for people to copy and edit, and a unit test
checks the files still match.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from .config import RouterConfig, parse_router_config
from .registry import PluginRegistry

_HEALTHY = {"name": "healthy", "type": "healthy", "parameters": {"max_age_s": 10.0}}
_HEADROOM = {"name": "kv-headroom", "type": "kv-headroom", "parameters": {"max_kv_usage": 0.95}}
# A request for a LoRA adapter goes only to workers that report it loaded.
_LORA = {"name": "lora-loaded", "type": "lora-loaded"}
_PICK = {"name": "pick", "type": "max-score", "parameters": {"tie_break": "random", "seed": 0}}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # Spreads requests evenly over healthy workers; the baseline for benchmarks.
    "round_robin": {
        "plugins": [_HEALTHY, _LORA, {"name": "rotate", "type": "round-robin"},
                    {"name": "pick", "type": "max-score",
                     "parameters": {"tie_break": "lowest-id"}}],
        "schedulingProfiles": [{"name": "round-robin", "plugins": [
            {"pluginRef": "healthy"}, {"pluginRef": "lora-loaded"}, {"pluginRef": "rotate"},
            {"pluginRef": "pick"}]}],
    },
    # Prefix reuse first, load second: the Dynamo KV router's usual trade-off.
    "kv_aware": {
        "plugins": [_HEALTHY, _LORA, _HEADROOM, {"name": "overlap", "type": "kv-overlap"},
                    {"name": "load", "type": "least-requests"}, _PICK],
        "schedulingProfiles": [{"name": "kv-aware", "plugins": [
            {"pluginRef": "healthy"}, {"pluginRef": "lora-loaded"}, {"pluginRef": "kv-headroom"},
            {"pluginRef": "overlap", "weight": 2.0}, {"pluginRef": "load", "weight": 1.0},
            {"pluginRef": "pick"}]}],
    },
    # The seed's latency cost with its default coefficients, spelled out for editing.
    "latency_cost": {
        "plugins": [_HEALTHY, _LORA, _HEADROOM,
                    {"name": "cost", "type": "latency-cost", "parameters": {
                        "occupancy_weight": 3.0, "active_requests_weight": 1.0,
                        "cache_match_weight": 10.0, "mem_bw_weight": 0.5,
                        "recent_prefix_weight": 1.0}},
                    _PICK],
        "schedulingProfiles": [{"name": "latency-cost", "plugins": [
            {"pluginRef": "healthy"}, {"pluginRef": "lora-loaded"}, {"pluginRef": "kv-headroom"},
            {"pluginRef": "cost", "weight": 1.0}, {"pluginRef": "pick"}]}],
    },
}


def builtin_config(name: str, registry: PluginRegistry) -> RouterConfig:
    """Return the validated built-in config ``name`` (a key of ``BUILTIN_CONFIGS``)."""
    if name not in BUILTIN_CONFIGS:
        raise KeyError(f"no built-in router config {name!r}; have {sorted(BUILTIN_CONFIGS)}")
    return parse_router_config(deepcopy(BUILTIN_CONFIGS[name]), registry, source=name)
