"""Config of the Router component (the `Router:` section of a graph config)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from splitserve.components.qos import QosConfig
from splitserve.serve.config import ComponentConfig


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
    recent_prefix_ttl_s: float = Field(30.0, gt=0, description="How long a routed prefix "
                                       "counts as 'recent' for the latency-cost scorer.")
    inflight_ttl_s: float = Field(600.0, gt=0, description="An unreleased placement stops "
                                  "counting as load after this long.")
    down_ttl_s: float = Field(30.0, gt=0, description="A worker a frontend could not "
                              "reach is not routed to until it reports its load again, "
                              "leaves discovery, or this long has passed.")
    qos: QosConfig = Field(default_factory=QosConfig, description="Priority classes, "
                           "admission control and graceful degradation (see docs/qos.md).")

    def preflight(self) -> list[str]:
        """Build the routing policy once (reading a policy file it names), so a missing or
        invalid file fails `dynamo serve` validation instead of crash-looping the router."""
        from splitserve.components.router.service import load_policy

        try:
            load_policy(self)
        except FileNotFoundError:
            return [f"policy: {self.policy!r} is not a built-in policy (round_robin, "
                    "kv_aware, latency_cost) and no such file exists"]
        except Exception as exc:  # noqa: BLE001 - any failure to build is a config error
            return [f"policy: {' '.join(str(exc).split())}"]
        return []
