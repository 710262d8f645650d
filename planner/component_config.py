"""Config of the Planner component (the `Planner:` section of a graph config)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from splitserve.contracts.prefill_queue import PrefillQueueConfig
from splitserve.contracts.config import ComponentConfig


class PlannerComponentConfig(ComponentConfig):
    """Where the planner's policy comes from and how it acts."""

    policy: str | dict[str, Any] = Field(
        description="A planner/policy file path, or the document inline: the seed's "
        "`autoscale` section plus an optional `planner:` block (see docs/planner.md).")
    connector: Literal["local", "kubernetes", "dry-run"] = Field(
        "local", description="local: the `dynamo serve` supervisor's control endpoint; "
        "kubernetes: patch Deployments; dry-run: log only.")
    kubernetes_namespace: str = Field("splitserve", min_length=1,
                                      description="Namespace of the graph's Deployments.")
    components: dict[str, str] = Field(
        default_factory=lambda: {"prefill": "PrefillWorker", "decode": "DecodeWorker"},
        description="Pool -> component name.")
    prefill_queue: PrefillQueueConfig = Field(default_factory=PrefillQueueConfig)

    @field_validator("policy")
    @classmethod
    def _policy_loads(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        from .config import load_planner_policy, parse_planner_policy

        if isinstance(v, dict):
            parse_planner_policy(v, "Planner.policy")
        else:
            load_planner_policy(v)
        return v
