"""The ``degradation`` part of the QoS config: one switchable block per step.

Every step only ever applies to admitted requests of classes with ``may_degrade``; the
rules themselves are in ``degrade``.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from splitserve.contracts.models import StrictModel


class _Step(StrictModel):
    model_config = ConfigDict(allow_inf_nan=False)

    enable: bool = Field(default=True, description="false: this step never fires.")


class CapMaxTokens(_Step):
    """Cap ``max_tokens`` of degradable requests while the system is under pressure."""

    max_tokens: int = Field(default=256, ge=1,
                            description="The cap applied to requests asking for more.")
    est_ttft_ratio: float = Field(
        default=0.8, gt=0, description="Fires when est_ttft_ms >= ratio x the class's "
        "ttft_ms (needs a measured, fresh estimate).")
    kv_usage_threshold: float = Field(
        default=0.85, gt=0, le=1.0, description="Fires when decode KV usage >= this "
        "fraction, whatever the estimate.")


class LocalPrefillForLowPriority(_Step):
    """Keep degradable requests off the shared prefill pool while its queue is long."""

    prefill_queue_depth_threshold: int = Field(
        default=8, ge=1, description="Fires when the prefill queue holds at least this "
        "many requests; the decode worker then prefills the request itself.")


class AdaptiveGenerationLimit(_Step):
    """Shrink the generation limit in proportion to how far TPOT is over the class target."""

    min_tokens: int = Field(default=64, ge=1,
                            description="Floor: the limit never goes below this.")


class DegradationConfig(StrictModel):
    """The three graceful-degradation steps, each with its own switch."""

    cap_max_tokens: CapMaxTokens = Field(default_factory=CapMaxTokens,
                                         description="Cap max_tokens under pressure.")
    disable_remote_prefill_for_low_priority: LocalPrefillForLowPriority = Field(
        default_factory=LocalPrefillForLowPriority,
        description="Prefill degradable requests locally while the prefill queue is long.")
    adaptive_generation_limit: AdaptiveGenerationLimit = Field(
        default_factory=AdaptiveGenerationLimit,
        description="Lower max_tokens proportionally when est TPOT exceeds the target.")
