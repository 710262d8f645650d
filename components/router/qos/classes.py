"""Priority classes, the ``qos`` policy section, and resolving a request's class.

The seed's section loads as written::

    qos: {enable_early_rejection: true, low_priority_threshold_ms: 500,
          reject_on_slo_violation: true}

Default classes, most important first (the names match the prefill queue's levels):

========  =======  =======  ==========  ===========
name      ttft_ms  tpot_ms  may_reject  may_degrade
========  =======  =======  ==========  ===========
high      1000     100      no          no
default   2000     150      no          no
low       5000     250      yes         yes
========  =======  =======  ==========  ===========

Only ``low`` is rejected or degraded by default, as in the seed ("reject low priority");
capping tokens truncates answers, so it is opt-in per class.  A class needs only its name
and targets: ``may_reject`` and ``may_degrade`` default to false, so admission "on" for
every request is ``classes: [{name: default, ttft_ms: ..., tpot_ms: ..., may_reject:
true}]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import InitErrorDetails

from splitserve.contracts.models import StrictModel
from splitserve.contracts.priority import DEFAULT_CLASS, DEFAULT_CLASSES, PriorityTable
from splitserve.contracts.validation import issue, raise_if_any

from .degrade_config import DegradationConfig
from .estimator import EstimatorParams, LatencyEstimator
from .hold import HoldConfig
from .slack_queue import QueueConfig
from .types import ClassResolution

CLASS_NAME_PATTERN = r"^[a-z][a-z0-9_-]*$"


class PriorityClass(StrictModel):
    """One priority class: its latency targets and what QoS may do to its requests."""

    model_config = ConfigDict(allow_inf_nan=False)

    name: str = Field(pattern=CLASS_NAME_PATTERN, description="Lower-case class name.")
    ttft_ms: float = Field(gt=0, description="Time-to-first-token target (ms).")
    tpot_ms: float = Field(gt=0, description="Time-per-output-token target (ms).")
    may_reject: bool = Field(default=False, description="Whether admission may answer 503 "
                             "for this class (its requests predicted to miss the targets).")
    may_degrade: bool = Field(default=False, description="Whether degradation steps may "
                              "apply (they shorten answers, so off unless asked for).")


def default_classes() -> tuple[PriorityClass, ...]:
    """Return the built-in classes (see the module docstring), most important first:
    the contracts' built-in priority table (``DEFAULT_CLASSES``) with their targets."""
    targets = {"high": dict(ttft_ms=1000, tpot_ms=100, may_reject=False, may_degrade=False),
               "default": dict(ttft_ms=2000, tpot_ms=150, may_reject=False,
                               may_degrade=False),
               "low": dict(ttft_ms=5000, tpot_ms=250, may_reject=True, may_degrade=True)}
    return tuple(PriorityClass(name=name, **targets[name]) for name in DEFAULT_CLASSES)


class QosConfig(StrictModel):
    """The ``qos`` policy section."""

    model_config = ConfigDict(allow_inf_nan=False)

    classes: tuple[PriorityClass, ...] = Field(
        default_factory=default_classes, min_length=1,
        description="Priority classes, most important first; names unique.")
    default_class: str = Field(
        default=DEFAULT_CLASS,
        description="Class of requests that name none, or an unknown one.")
    header: str | None = Field(
        default=None, description="Refused: the frontend, which may run without this "
        "config (routing in the Router process), reads the class from the request header "
        "that `Frontend.priority_header` names (default x-priority).")
    metadata_key: str = Field(
        default="priority", min_length=1,
        description="Key of the OpenAI request's `metadata` object naming the class.")
    user_map: dict[str, str] = Field(
        default_factory=dict,
        description="OpenAI `user` -> class, used when neither header nor metadata names one.")
    mode: Literal["enforce", "shadow"] = Field(
        default="enforce", description="enforce: refuse (or hold) what is predicted to miss "
        "its class's targets; shadow: decide and record the same way (metrics, calibration) "
        "but admit everything, hold nothing and degrade nothing.")
    placement: Literal["slo-prefix", "slo", "policy"] = Field(
        default="slo-prefix", description="slo-prefix: among the routing policy's candidates "
        "holding at least as much of the prompt as its pick, place each request where its "
        "predicted TTFT and TPOT use the smallest share of its class's targets (the prefix "
        "hit counts: cached tokens are not prefilled), so that a prefix is not computed "
        "again elsewhere for a smaller batch; slo: the same among all candidates; policy: "
        "keep the routing policy's pick unless it would miss the targets. "
        "Learned fits only; during warm-up the policy's pick stands either way. Shadow "
        "mode moves nothing.")
    enable_early_rejection: bool = Field(
        default=True, description="Master switch: false and admission never rejects.")
    reject_on_slo_violation: bool = Field(
        default=True, description="Reject rejectable classes whose estimated TTFT exceeds "
        "their limit (see low_priority_threshold_ms). Needs enable_early_rejection.")
    low_priority_threshold_ms: float = Field(
        default=500.0, ge=0, description="Slack (ms) added to the TTFT target of every "
        "class with may_reject before rejecting: reject iff est_ttft_ms > max(ttft_ms, "
        "unloaded_ttft_ms) + this.")
    degradation: DegradationConfig = Field(default_factory=DegradationConfig,
                                           description="Graceful-degradation steps.")
    estimate_max_age_s: float = Field(
        default=1.0, gt=0, description="An estimate whose backlog is older than this is "
        "stale and never justifies a rejection or an estimate-driven degradation.")
    estimator: EstimatorParams = Field(default_factory=EstimatorParams,
                                       description="EMA smoothing and warm-up rates.")
    queue: QueueConfig = Field(default_factory=QueueConfig,
                               description="The router's admission queue: waiting requests "
                               "served by least slack, doomed ones shed (off by default).")
    hold: HoldConfig = Field(default_factory=HoldConfig,
                             description="Requests turned away for the batch they would "
                             "join wait in the router and are judged again (on by default).")

    @model_validator(mode="after")
    def _references(self) -> QosConfig:
        # One check for every reference, each error at its own path (classes.2.name,
        # user_map.alice); pydantic nests these under the section's path in a file.
        lines: list[InitErrorDetails] = []
        first: dict[str, int] = {}
        for i, cls in enumerate(self.classes):
            if cls.name in first:
                lines.append(issue(("classes", i, "name"), f"class name {cls.name!r} is "
                                   f"repeated; classes.{first[cls.name]}.name has it", cls.name))
            first.setdefault(cls.name, i)
        known = list(first)
        if self.default_class not in first:
            lines.append(issue(("default_class",), f"default_class {self.default_class!r} is "
                               f"not one of classes[].name {known}", self.default_class))
        for user, name in self.user_map.items():
            if name not in first:
                lines.append(issue(("user_map", user), f"user_map sends {user!r} to "
                                   f"{name!r}, which is not one of classes[].name {known}",
                                   name))
        if self.header is not None:
            lines.append(issue(("header",), "qos.header is not read: the frontend takes the "
                               "class from the request header that Frontend.priority_header "
                               "names (default x-priority); remove qos.header", self.header))
        raise_if_any("qos", lines)
        return self

    def class_named(self, name: str) -> PriorityClass | None:
        """Return the class called ``name``, or None; called per request by admission."""
        return next((c for c in self.classes if c.name == name), None)

    def class_tpot_ms(self, name: str) -> float | None:
        """The TPOT target of class ``name`` (None for a name the classes lack)."""
        cls = self.class_named(name)
        return cls.tpot_ms if cls is not None else None

    def priority_table(self) -> PriorityTable:
        """The classes' order as the contracts' priority table: what the router ranks a
        resolved class by (``RouteReply.class_level``) and every engine schedules by."""
        return PriorityTable(tuple(c.name for c in self.classes), self.default_class)

    def rank(self, name: str) -> int:
        """Return the class's level in ``priority_table()`` (0 = most important); a name
        the classes lack ranks as ``default_class`` (``contracts/priority.py``'s rule)."""
        return self.priority_table().level_of(name)


def build_estimator(config: QosConfig) -> LatencyEstimator:
    """Return a fresh estimator with the config's EMA parameters and staleness limit.

    Called by the adapter at start-up, and on a reload that changes ``estimator`` or
    ``estimate_max_age_s`` (a new estimator starts from the warm-up rates again).
    """
    return LatencyEstimator(config.estimator, max_age_s=config.estimate_max_age_s)


def _normalised(raw: Any) -> str | None:
    """Header and metadata values compare case- and space-insensitively; '' means absent."""
    if raw is None:
        return None
    text = str(raw).strip().lower()
    return text or None


def resolve_class(header_value: str | None, user: str | None,
                  metadata: Mapping[str, Any] | None, config: QosConfig) -> ClassResolution:
    """Decide a request's class; called by the frontend once per request before admission.

    The first source that names a class decides: the header, then ``metadata[metadata_key]``,
    then ``user_map[user]``, else ``default_class``.  A source naming an unknown class gives
    the default class with reason 'unknown-class' (it does not fall through to the next
    source: a typo should be visible, not silently overridden).
    """
    sources: list[tuple[str, Any]] = [
        ("header", header_value),
        ("metadata", (metadata or {}).get(config.metadata_key)),
    ]
    for source, raw in sources:
        wanted = _normalised(raw)
        if wanted is not None:
            return _named(wanted, source, source, config)
    if user is not None and user in config.user_map:
        return _named(config.user_map[user], "user", "user-map", config)
    return ClassResolution(name=config.default_class, source="default", reason="default")


def _named(wanted: str, source: str, reason: str, config: QosConfig) -> ClassResolution:
    if config.class_named(wanted) is not None:
        return ClassResolution(name=wanted, source=source, reason=reason, requested=wanted)
    return ClassResolution(name=config.default_class, source=source, reason="unknown-class",
                           requested=wanted)
