"""Decider ``score``: the score-based offload policy.

Each rule names a metric, a condition and a signed weight::

    - {metric: prefill_length, threshold: 256, action: prefer_remote, weight: 0.7}
    - {metric: prefill_queue_depth, threshold: 10, action: prefer_local, weight: 0.3}
    - {metric: priority, classes: [batch], action: prefer_remote, weight: 0.2}

Combination, exactly:

1. A numeric rule *fires* when ``metric value >= threshold`` (see ``metrics.metric_value``
   for how each metric is measured).  A ``priority`` rule has no threshold; it fires when
   the request's priority class is one of ``classes``.  (Class names, not ranks: the
   classes are defined by the QoS config, and a list says exactly which ones a rule is
   about without inventing an order between them.)
2. A fired rule contributes ``+weight`` if its action is ``prefer_remote`` and ``-weight``
   if ``prefer_local``; a rule that does not fire contributes 0.
3. ``score`` is the sum of contributions, rounded to 9 decimals so that 0.7 - 0.2 counts as
   0.5 rather than 0.49999999999999994.
4. Prefill is remote iff ``score >= remote_prefill_min_score`` (reason 'min-score-met'),
   otherwise local (reason 'below-min-score').

Because nothing fires by default, the score of an unremarkable request is 0 and, with a
positive minimum, it stays local: offload is opt-in by rule.  With the seed's policy:
long prompt and short queue -> 0.7 >= 0.5, remote; long prompt and queue >= 10 -> 0.4,
local; short prompt -> 0 or -0.3, local.

``contributions`` in the decision holds, per metric, the sum of its rules' contributions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from splitserve.contracts.models import StrictModel

from .metrics import FRACTION_METRICS, NUMERIC_METRICS, Metric, metric_value
from .types import OffloadDecision, OffloadRequest, OffloadSnapshot

TYPE_NAME = "score"

Action = Literal["prefer_remote", "prefer_local"]


class Rule(StrictModel):
    """One scoring rule."""

    metric: Metric = Field(description="What the rule looks at; see the module docstring.")
    threshold: float | None = Field(
        default=None, ge=0.0, validate_default=True,
        description="Numeric metrics: the rule fires when the value is >= this.  Not allowed "
        "for `priority`.  For `decode_kv_usage` a fraction in [0, 1].")
    classes: list[str] | None = Field(
        default=None, validate_default=True,
        description="`priority` only: the rule fires when the request's class is listed.")
    action: Action = Field(description="prefer_remote adds the weight, prefer_local "
                           "subtracts it.")
    weight: float = Field(ge=0.0, description="How much the rule moves the score.")

    @field_validator("threshold")
    @classmethod
    def _threshold_fits_metric(cls, value: float | None, info: ValidationInfo) -> float | None:
        metric = info.data.get("metric")
        if metric is None:  # the metric itself was invalid and is reported already
            return value
        if metric in NUMERIC_METRICS and value is None:
            raise ValueError(f"a threshold is required for metric {metric!r}")
        if metric not in NUMERIC_METRICS and value is not None:
            raise ValueError(f"metric {metric!r} takes `classes`, not a threshold")
        if metric in FRACTION_METRICS and value is not None and value > 1.0:
            raise ValueError(f"metric {metric!r} is a fraction; threshold {value} is above 1")
        return value

    @field_validator("classes")
    @classmethod
    def _classes_fit_metric(cls, value: list[str] | None,
                            info: ValidationInfo) -> list[str] | None:
        metric = info.data.get("metric")
        if metric is None:
            return value
        if metric == "priority" and not value:
            raise ValueError("metric 'priority' needs a non-empty `classes` list")
        if metric != "priority" and value is not None:
            raise ValueError(f"`classes` is only for metric 'priority', not {metric!r}")
        return value

    def fires(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> bool:
        """Return whether the rule's condition holds for this request and load."""
        if self.metric == "priority":
            return request.priority in (self.classes or ())
        assert self.threshold is not None  # guaranteed by the validator for numeric metrics
        return metric_value(self.metric, request, snapshot) >= self.threshold


def _seed_rules() -> list[Rule]:
    return [Rule(metric="prefill_length", threshold=256, action="prefer_remote", weight=0.7),
            Rule(metric="prefill_queue_depth", threshold=10, action="prefer_local", weight=0.3)]


class Params(StrictModel):
    """Parameters of the ``score`` decider; the defaults are the seed's example policy."""

    policies: list[Rule] = Field(default_factory=_seed_rules, min_length=1,
                                 description="The scoring rules, all evaluated.")
    remote_prefill_min_score: float = Field(
        default=0.5, gt=0.0,
        description="Remote iff the score reaches this.  Must be > 0 (otherwise requests no "
        "rule spoke for would be offloaded) and reachable by the prefer_remote weights.")

    @field_validator("remote_prefill_min_score")
    @classmethod
    def _reachable(cls, value: float, info: ValidationInfo) -> float:
        rules = info.data.get("policies")
        if rules is None:
            return value
        best = round(sum(r.weight for r in rules if r.action == "prefer_remote"), 9)
        if value > best:
            raise ValueError(f"remote_prefill_min_score {value} is above the highest "
                             f"reachable score {best} (sum of prefer_remote weights); "
                             "prefill could never go remote, use `enable: false` instead")
        return value


class ScoreDecider:
    """Sums the fired rules' signed weights and compares with the minimum score."""

    def __init__(self, params: Params) -> None:
        self._rules = tuple(params.policies)
        self._min_score = params.remote_prefill_min_score

    def decide(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> OffloadDecision:
        """Called per request; returns the decision with the score and per-metric parts."""
        contributions: dict[str, float] = {}
        for rule in self._rules:
            part = 0.0
            if rule.fires(request, snapshot):
                part = rule.weight if rule.action == "prefer_remote" else -rule.weight
            contributions[rule.metric] = contributions.get(rule.metric, 0.0) + part
        score = round(sum(contributions.values()), 9)
        remote = score >= self._min_score
        return OffloadDecision(remote=remote,
                               reason="min-score-met" if remote else "below-min-score",
                               score=score, contributions=contributions)
