"""The ``qos`` section: early rejection, priority classes and graceful degradation.

Read by the admission controller (in the router) and the frontend, which maps each
request to a class: the ``header`` first, then the OpenAI ``user`` field through
``user_map``, then ``metadata[metadata_key]``, then ``default_class`` (when unset, the
least important class, resolved by ``QosPolicy.fallback_class``, not by a validator).
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails

from .base import PolicyModel, check, problem

CLASS_NAME = r"^[a-z][a-z0-9_-]*$"


class PriorityClass(PolicyModel):
    """One priority class and its latency targets."""

    name: str = Field(pattern=CLASS_NAME, description="Class name (lower case), as sent in "
                                                      "the priority header.")
    ttft_ms: float | None = Field(default=None, gt=0.0,
                                  description="Time-to-first-token target, milliseconds.")
    tpot_ms: float | None = Field(default=None, gt=0.0,
                                  description="Time-per-output-token target, milliseconds.")
    may_reject: bool = Field(default=False, description="Requests of this class may be "
                                                        "rejected early (HTTP 503).")
    may_degrade: bool = Field(default=False, description="Requests of this class may be "
                                                         "degraded (see `degradation`).")


class CapMaxTokens(PolicyModel):
    """Cap ``max_tokens`` of degradable requests while the system is under pressure."""

    enable: bool = Field(default=False, description="Turn the measure on.")
    max_tokens: int = Field(default=256, ge=1, description="The cap on generated tokens.")


class LocalPrefillForLowPriority(PolicyModel):
    """Keep degradable requests off the prefill pool when its queue is deep."""

    enable: bool = Field(default=False, description="Turn the measure on.")
    queue_depth: int = Field(default=10, ge=0, description="Prefill-queue depth from which "
                                                           "degradable requests prefill locally.")


class AdaptiveGenerationLimit(PolicyModel):
    """Shrink the token limit of degradable requests as decode KV usage grows."""

    enable: bool = Field(default=False, description="Turn the measure on.")
    max_tokens: int = Field(default=1024, ge=1, description="Limit at or below `start_kv_usage`.")
    min_tokens: int = Field(default=64, ge=1, description="Limit at or above `full_kv_usage`.")
    start_kv_usage: float = Field(default=70.0, ge=0.0, le=100.0,
                                  description="Decode KV usage (percent) where shrinking starts.")
    full_kv_usage: float = Field(default=95.0, ge=0.0, le=100.0,
                                 description="Decode KV usage (percent) where the limit "
                                             "reaches `min_tokens`.")

    @model_validator(mode="after")
    def _ranges(self) -> Self:
        lines: list[InitErrorDetails] = []
        if self.min_tokens > self.max_tokens:
            lines.append(problem(("min_tokens",), f"min_tokens ({self.min_tokens}) must not "
                                 f"exceed max_tokens ({self.max_tokens})", self.min_tokens))
        if self.start_kv_usage >= self.full_kv_usage:
            lines.append(problem(("start_kv_usage",), f"start_kv_usage ({self.start_kv_usage:g})"
                                 f" must be below full_kv_usage ({self.full_kv_usage:g})",
                                 self.start_kv_usage))
        check(lines)
        return self


class Degradation(PolicyModel):
    """Measures applied to classes with ``may_degrade`` instead of rejecting them."""

    cap_max_tokens: CapMaxTokens | None = Field(default=None, description="Fixed token cap.")
    disable_remote_prefill_for_low_priority: LocalPrefillForLowPriority | None = Field(
        default=None, description="Local prefill for degradable requests on a deep queue.")
    adaptive_generation_limit: AdaptiveGenerationLimit | None = Field(
        default=None, description="Token limit that shrinks with decode KV usage.")

    def enabled(self) -> list[str]:
        """Return the names of the measures turned on, in file order."""
        return [name for name in type(self).model_fields
                if getattr(getattr(self, name), "enable", False)]


class QosPolicy(PolicyModel):
    """Admission control and priority classes."""

    enable_early_rejection: bool = Field(
        description="Reject requests whose estimated TTFT misses their target before they "
                    "queue (HTTP 503 with Retry-After).")
    low_priority_threshold_ms: float = Field(
        gt=0.0, description="TTFT target (ms) of low-priority requests when no class sets one.")
    reject_on_slo_violation: bool = Field(
        default=False, description="Also reject when the estimate exceeds a class's target "
                                   "while queued, not only on arrival.")
    classes: list[PriorityClass] = Field(
        default_factory=list, description="Priority classes, most important first.")
    default_class: str | None = Field(
        default=None, description="Class of requests that name none; the last class if unset.")
    header: str = Field(default="x-priority", min_length=1, pattern=r"^[A-Za-z0-9-]+$",
                        description="HTTP header naming the request's class.")
    user_map: dict[str, str] = Field(
        default_factory=dict, description="OpenAI `user` value -> class name.")
    metadata_key: str | None = Field(
        default=None, min_length=1, description="Key of the OpenAI `metadata` object whose "
                                                "value names the class.")
    degradation: Degradation | None = Field(default=None, description="Degradation measures.")

    def fallback_class(self) -> str | None:
        """Return the class of a request that names none; called when resolving settings."""
        if self.default_class is not None:
            return self.default_class
        return self.classes[-1].name if self.classes else None

    @model_validator(mode="after")
    def _references(self) -> Self:
        lines: list[InitErrorDetails] = []
        first: dict[str, int] = {}
        for i, cls in enumerate(self.classes):
            if cls.name in first:
                lines.append(problem(("classes", i, "name"), f"duplicate class name "
                                     f"{cls.name!r}; classes.{first[cls.name]}.name has it "
                                     "already", cls.name))
            first.setdefault(cls.name, i)
        known = ", ".join(first) or "none defined"
        if self.default_class is not None and self.default_class not in first:
            lines.append(problem(("default_class",), f"default_class {self.default_class!r} "
                                 f"is not among classes[].name ({known})", self.default_class))
        for user, name in self.user_map.items():
            if name not in first:
                lines.append(problem(("user_map", user), f"class {name!r} is not among "
                                     f"classes[].name ({known})", name))
        if self.metadata_key is not None and not self.classes:
            lines.append(problem(("metadata_key",), "metadata_key needs classes to map to",
                                 self.metadata_key))
        degradable = any(cls.may_degrade for cls in self.classes)
        for measure in self.degradation.enabled() if self.degradation else []:
            if not degradable:
                lines.append(problem(("degradation", measure, "enable"), f"degradation.{measure}"
                                     " is enabled but no classes[].may_degrade is true",
                                     True))
        check(lines)
        return self
