"""Inputs and outputs of the disaggregated router (remote or local prefill)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class FrozenModel(BaseModel):
    """Immutable data with strict keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class OffloadRequest(FrozenModel):
    """The request-side inputs, known when the decode worker receives the request."""

    request_id: str = Field(default="", description="For tracing only.")
    prompt_length: int = Field(ge=0, description="Prompt length in tokens.")
    prefix_cached_length: int = Field(
        default=0, ge=0, description="Prompt tokens already cached on this decode worker.")
    priority: str = Field(default="default", description="Priority class name (QoS).")

    @property
    def prefill_length(self) -> int:
        """Tokens that still need prefilling after this worker's prefix-cache hit."""
        return max(0, self.prompt_length - self.prefix_cached_length)


class OffloadSnapshot(FrozenModel):
    """The load-side inputs, read by the decode worker just before deciding."""

    prefill_queue_depth: int = Field(default=0, ge=0,
                                     description="Requests waiting in the prefill queue.")
    decode_active_requests: int = Field(default=0, ge=0,
                                        description="Requests this decode worker is serving.")
    decode_kv_usage: float = Field(default=0.0, ge=0.0, le=1.0,
                                   description="Fraction of this worker's KV blocks in use.")
    live_prefill_workers: int = Field(
        default=1, ge=0, description="Prefill workers alive in the pool; with 0 the answer "
        "is always local prefill.")


class OffloadDecision(FrozenModel):
    """Remote or local prefill, with a short machine-readable reason for metrics labels."""

    remote: bool = Field(description="True: enqueue on the prefill pool; False: prefill here.")
    reason: str = Field(description="e.g. 'prefill-length>=256', 'queue-full', "
                        "'below-min-score', 'no-prefill-workers', 'disabled'.")
    score: float | None = Field(default=None,
                                description="The combined score, for score-based deciders.")
    contributions: dict[str, float] = Field(
        default_factory=dict, description="Per metric: its contribution to the score, or "
        "for rule-based deciders the value the rule compared.")


@runtime_checkable
class Decider(Protocol):
    """Decides where one request's prefill runs."""

    def decide(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> OffloadDecision:
        """Called by the decode worker once per new request; returns the decision."""
        ...
