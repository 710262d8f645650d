"""Data the router core reads and returns: requests, worker snapshots and decisions.

All of it is plain frozen data.  The router process builds a ``Snapshot`` from worker
metrics, the prefix index (Dynamo's radix tree) and the recent-routing tracker, hands it
to ``Router.route`` together with a ``RouteRequest`` and gets a ``Decision`` back, which it
can log, turn into metrics, or print with ``dynamo route explain``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

WorkerId = int


class FrozenModel(BaseModel):
    """Immutable data with strict keys, so a decision cannot be edited after it is made."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RouteRequest(FrozenModel):
    """One request to place on a decode worker, as the router sees it after tokenising."""

    request_id: str = Field(description="Identifier carried into the decision for tracing.")
    num_tokens: int = Field(ge=0, description="Prompt length in tokens.")
    num_blocks: int = Field(ge=0, description="Number of KV blocks the prompt spans.")
    priority: str = Field(default="default", description="Priority class name (QoS).")
    block_hashes: tuple[int, ...] = Field(
        default=(), description="Hashes of the prompt's prefix blocks, oldest first; empty "
        "when the caller does not track prefixes.  Keyed by ``lora``: an adapter's blocks "
        "never match the base model's.")
    lora: str | None = Field(default=None, description="The LoRA adapter the request is "
                             "served with; None: the base model.")


class WorkerState(FrozenModel):
    """Latest metrics of one decode worker."""

    worker_id: WorkerId = Field(description="Worker (instance) id.")
    active_requests: int = Field(default=0, ge=0, description="Requests being decoded.")
    waiting_requests: int = Field(default=0, ge=0, description="Requests queued, not started.")
    kv_blocks_used: int = Field(default=0, ge=0, description="KV blocks in use.")
    kv_blocks_total: int = Field(default=0, ge=0,
                                 description="KV block capacity; 0 when not reported yet.")
    mem_bw_util: float = Field(default=0.0, ge=0.0, le=1.0,
                               description="Memory-bandwidth utilisation; 0 when unknown.")
    healthy: bool = Field(default=True, description="False once the worker failed checks.")
    draining: bool = Field(default=False, description="True while shutting down gracefully.")
    last_seen_s: float = Field(default=0.0, ge=0.0,
                               description="Seconds since the worker's last metrics report.")
    loras: frozenset[str] = Field(default=frozenset(), description="LoRA adapters the "
                                  "worker reports loaded.")

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use; 0 when the capacity is unknown (nothing reported)."""
        if self.kv_blocks_total == 0:
            return 0.0
        return min(1.0, self.kv_blocks_used / self.kv_blocks_total)

    @property
    def load(self) -> int:
        """Requests on the worker, running or queued."""
        return self.active_requests + self.waiting_requests


class Snapshot(FrozenModel):
    """Everything the router knows about the fleet at the moment of one decision."""

    workers: tuple[WorkerState, ...] = Field(description="Known decode workers.")
    overlap_blocks: dict[WorkerId, int] = Field(
        default_factory=dict, description="Per worker, how many of the request's prefix "
        "blocks it already caches (from the prefix index); missing means 0.")
    tier_overlap_blocks: dict[WorkerId, dict[str, int]] = Field(
        default_factory=dict, description="Per worker, the request's prefix blocks it "
        "holds in each KV tier (device, host, disk; each block counted once, at the "
        "fastest tier holding it); missing means none.")
    weighted_overlap_blocks: dict[WorkerId, float] = Field(
        default_factory=dict, description="Per worker, ``tier_overlap_blocks`` weighed "
        "by tier (a device block 1.0, host and disk blocks the router's "
        "``host_cache_hit_weight`` / ``disk_cache_hit_weight``); missing means "
        "``overlap_blocks``.")
    recent_prefix_blocks: dict[WorkerId, int] = Field(
        default_factory=dict, description="Per worker, how many of the request's prefix "
        "blocks were recently routed to it (RecentPrefixTracker); missing means 0.")


class FilterRemoval(FrozenModel):
    """One worker a filter took out of the candidate set, and why."""

    plugin: str = Field(description="Name of the filter plugin in the config.")
    worker_id: WorkerId
    reason: str = Field(description="Short, human-readable reason.")


class ScorerBreakdown(FrozenModel):
    """What one scorer said about each candidate, before and after its weight."""

    plugin: str = Field(description="Name of the scorer plugin in the config.")
    weight: float
    raw: dict[WorkerId, float] = Field(description="Scores after clamping to [0, 1].")
    weighted: dict[WorkerId, float] = Field(description="raw x weight (/ total weight when "
                                            "the profile normalises).")


class Decision(FrozenModel):
    """The outcome of routing one request, with everything needed to explain it."""

    request_id: str
    lora: str | None = Field(default=None, description="The request's LoRA adapter.")
    profile: str = Field(description="Scheduling profile that made the decision.")
    worker_id: WorkerId | None = Field(description="Chosen worker; None when none survived.")
    reason: str = Field(description="'picked', 'no-workers' or 'all-filtered'.")
    candidates: tuple[WorkerId, ...] = Field(description="Workers left after the filters.")
    totals: dict[WorkerId, float] = Field(description="Per candidate, the summed score.")
    scorers: tuple[ScorerBreakdown, ...] = ()
    removed: tuple[FilterRemoval, ...] = ()
    notes: dict[str, str] = Field(default_factory=dict,
                                  description="Per plugin, remarks that removed nobody.")
    elapsed_ns: dict[str, int] = Field(default_factory=dict,
                                       description="Per plugin, time spent in it.")

    tier_hits: dict[WorkerId, dict[str, int]] = Field(
        default_factory=dict, description="Per candidate with a prefix hit, its hit "
        "blocks per KV tier (device, host, disk).")

    def to_json(self) -> str:
        """Serialise for logs and ``dynamo route explain --json``."""
        return self.model_dump_json()
