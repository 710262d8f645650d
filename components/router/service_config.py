"""Config of the Router component (the `Router:` section of a graph config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from splitserve.components.router.qos import QosConfig
from splitserve.contracts.config import ComponentConfig

from .builtin import BUILTIN_CONFIGS, builtin_config
from .config import RouterConfig, load_router_config_file, parse_router_config
from .core import Router, build_router
from .registry import default_registry


class RouterComponentConfig(ComponentConfig):
    """Where the routing policy comes from and how the fleet is observed."""

    policy: str | dict[str, Any] = Field(
        "kv_aware", description="A built-in policy name (round_robin, kv_aware, "
        "latency_cost), a path to a policy YAML file, or the policy inline.")
    profile: str | None = Field(None, description="Scheduling profile to use; default: the "
                                "policy's defaultProfile or its first profile.")
    worker_component: str | None = Field(None, min_length=1, description="Component whose "
                                         "`generate` endpoint serves the routed requests; "
                                         "default: the one the graph links the router to.")
    block_size: int = Field(16, ge=1, description="KV block size of the workers, in tokens "
                            "(must match theirs for prefix matching).")
    use_kv_events: bool = Field(True, description="Follow the workers' KV events with "
                                "Dynamo's indexer for prefix overlap scores.")
    host_cache_hit_weight: float = Field(
        0.75, ge=0.0, le=1.0, allow_inf_nan=False, description="Credit of a prefix block "
        "a worker holds in its host-memory KV tier, relative to one in its KV pool (1.0): "
        "it must be copied back before it is used.  Dynamo's KvRouterConfig default.")
    disk_cache_hit_weight: float = Field(
        0.25, ge=0.0, le=1.0, allow_inf_nan=False, description="Credit of a prefix block "
        "a worker holds in its disk KV tier, relative to one in its KV pool (1.0): it must "
        "be read back from disk.  Dynamo's KvRouterConfig default.")
    recent_prefix_ttl_s: float = Field(30.0, gt=0, description="How long a routed prefix "
                                       "counts as 'recent' for the latency-cost scorer.")
    inflight_ttl_s: float = Field(600.0, gt=0, description="An unreleased placement stops "
                                  "counting as load after this long.")
    down_ttl_s: float = Field(30.0, gt=0, description="A worker a frontend could not "
                              "reach is not routed to until it reports its load again, "
                              "leaves discovery, or this long has passed.")
    qos: QosConfig = Field(default_factory=QosConfig, description="Priority classes, "
                           "admission control and graceful degradation (see docs/qos.md).")

    def tier_weights(self) -> dict[str, float]:
        """The credit of a prefix block by the tier holding it (``weighted_overlap``)."""
        return {"device": 1.0, "host": self.host_cache_hit_weight,
                "disk": self.disk_cache_hit_weight}

    def preflight(self) -> list[str]:
        """Build the routing policy once (reading a policy file it names), so a missing or
        invalid file fails `dynamo serve` validation instead of crash-looping the router."""
        try:
            load_policy(self)
        except FileNotFoundError:
            return [f"policy: {self.policy!r} is not a built-in policy (round_robin, "
                    "kv_aware, latency_cost) and no such file exists"]
        except Exception as exc:  # noqa: BLE001 - any failure to build is a config error
            return [f"policy: {' '.join(str(exc).split())}"]
        return []


def load_policy(cfg: RouterComponentConfig) -> Router:
    """Build the Router core from a built-in name, a YAML file path, an inline dict, or an
    already parsed RouterConfig (a policy version's `router` section)."""
    registry = default_registry()
    if isinstance(cfg.policy, RouterConfig):
        rc = cfg.policy
    elif isinstance(cfg.policy, dict):
        rc = parse_router_config(cfg.policy, registry, source="Router.policy")
    elif cfg.policy in BUILTIN_CONFIGS:
        rc = builtin_config(cfg.policy, registry)
    else:
        rc = load_router_config_file(Path(cfg.policy), registry)
    return build_router(rc, registry)
