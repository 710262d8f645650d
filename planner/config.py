"""The planner's policy: the seed's ``autoscale`` section plus an optional ``planner`` block.

``autoscale`` is the policy file's own section model (``splitserve.components.policy.sections``),
loaded unchanged; the ``planner`` block adds the knobs the seed leaves implicit (how
often to decide, cooldowns, hysteresis, step limits, a GPU budget, the oscillation guard
and SLA mode).  Every knob has a default, so a file with only the seed's ``autoscale``
section is a complete planner policy.  ``load_planner_policy`` is what the CLI and the
planner component call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails

from splitserve.components.policy.base import PolicyModel, check, problem
from splitserve.components.policy.decode import DocumentError, decode_document
from splitserve.components.policy.schema import PolicyError, error_lines, parse_policy
from splitserve.components.policy.sections import Autoscale

Predictor = Literal["constant", "moving-average", "linear-trend"]
PLANNER_KEYS = frozenset({"autoscale", "planner"})
SCHEMA_FILE = "planner.schema.json"


class Cooldown(PolicyModel):
    """Quiet periods after a change, per direction, per pool."""

    scale_up_s: float = Field(default=30.0, ge=0.0, description="Seconds after a scale-up of "
                              "a pool before the next scale-up of that pool.")
    scale_down_s: float = Field(default=120.0, ge=0.0, description="Seconds after any change "
                                "(up or down) of a pool before it may scale down; longer than "
                                "scale_up_s because a new replica needs time to take load.")


class Hysteresis(PolicyModel):
    """How many consecutive intervals a condition must hold before the planner acts."""

    scale_up_intervals: int = Field(default=1, ge=1, description="Consecutive intervals with "
                                    "a scale_up signal at or above its threshold.")
    scale_down_intervals: int = Field(default=3, ge=1, description="Consecutive intervals "
                                      "with every scale_down signal at or below its threshold.")


class MaxStep(PolicyModel):
    """The most replicas one pool gains or loses in one interval."""

    scale_up: int = Field(default=2, ge=1, description="Most replicas added per interval.")
    scale_down: int = Field(default=1, ge=1, description="Most replicas removed per interval.")


class GpuBudget(PolicyModel):
    """GPUs the two pools share: prefill and decode replicas times their GPUs fit in it."""

    total_gpus: int = Field(ge=1, description="GPUs available to prefill and decode together.")
    prefill_gpus_per_replica: int = Field(default=1, ge=1, description="GPUs one prefill "
                                          "replica holds (its tensor-parallel size).")
    decode_gpus_per_replica: int = Field(default=1, ge=1, description="GPUs one decode replica "
                                         "holds (its tensor-parallel size).")
    moves: bool = Field(default=True, description="When the budget is spent and one pool needs "
                        "capacity while the other is idle, move replicas between roles.")

    def per_replica(self, pool: str) -> int:
        """GPUs one replica of ``pool`` holds; called by the core's budget arithmetic."""
        return self.prefill_gpus_per_replica if pool == "prefill" else self.decode_gpus_per_replica


class PoolCapacity(PolicyModel):
    """What one replica sustains while meeting the SLA targets; set exactly one."""

    tokens_per_s: float | None = Field(default=None, gt=0.0, description="Tokens per second "
                                       "one replica sustains (prompt tokens for prefill, "
                                       "generated tokens for decode).")
    requests_per_s: float | None = Field(default=None, gt=0.0, description="Requests per "
                                         "second one replica sustains.")

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        if (self.tokens_per_s is None) == (self.requests_per_s is None):
            check([problem((), "set exactly one of tokens_per_s, requests_per_s", {})])
        return self


class SlaSettings(PolicyModel):
    """SLA mode: size each pool for the predicted load, with the thresholds as a safety net."""

    ttft_s: float | None = Field(default=None, gt=0.0, description="TTFT target, seconds. "
                                 "An observed TTFT above it asks the prefill pool for one more "
                                 "replica than the prediction; also the profiling target.")
    itl_s: float | None = Field(default=None, gt=0.0, description="Inter-token latency target, "
                                "seconds; the same for the decode pool.")
    predictor: Predictor = Field(default="moving-average", description="How the next "
                                 "interval's load is predicted from the recent ones.")
    window: int = Field(default=6, ge=1, description="Intervals of load history the "
                        "moving-average and linear-trend predictors use.")
    prefill: PoolCapacity | None = Field(default=None, description="Per-replica capacity of "
                                         "the prefill pool (measured by `dynamo planner "
                                         "profile`, or written here).")
    decode: PoolCapacity | None = Field(default=None, description="Per-replica capacity of "
                                        "the decode pool.")

    def capacity(self, pool: str) -> PoolCapacity | None:
        """The capacity of ``pool``, or None when SLA mode does not size it."""
        return self.prefill if pool == "prefill" else self.decode


class PlannerSettings(PolicyModel):
    """The ``planner`` block: everything the seed's ``autoscale`` section leaves implicit."""

    interval_s: float = Field(default=10.0, gt=0.0, description="Seconds between decisions; "
                              "the component ticks and the simulator steps at this period.")
    cooldown: Cooldown = Field(default_factory=Cooldown, description="Quiet periods.")
    hysteresis: Hysteresis = Field(default_factory=Hysteresis, description="Consecutive "
                                   "intervals a condition must hold.")
    max_step: MaxStep = Field(default_factory=MaxStep, description="Step limits per interval.")
    gpu_budget: GpuBudget | None = Field(default=None, description="Shared GPU budget; "
                                         "absent: only max_replicas bounds each pool.")
    oscillation_guard: bool = Field(default=True, description="Before scaling down, project "
                                    "the per-replica load onto the remaining replicas and "
                                    "refuse when it would reach a scale_up threshold.")
    unknown_signals: Literal["ignore", "hold"] = Field(
        default="ignore", description="A named signal with no reading (e.g. GPU utilisation "
        "on a CPU fleet): `ignore` skips it (scaling down still needs one reading), `hold` "
        "never scales that pool down.")
    sla: SlaSettings | None = Field(default=None, description="SLA mode; absent: thresholds only.")


class PlannerPolicy(PolicyModel):
    """What ``decide`` is given: the seed's ``autoscale`` section plus the ``planner`` block."""

    autoscale: Autoscale = Field(description="The policy file's autoscale section, unchanged.")
    planner: PlannerSettings = Field(default_factory=PlannerSettings,
                                     description="Planner knobs (all optional).")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        lines: list[InitErrorDetails] = []
        budget, sla = self.planner.gpu_budget, self.planner.sla
        if budget is not None:
            floor = sum(p.min_replicas * budget.per_replica(name)
                        for name, p in self.pools().items())
            if floor > budget.total_gpus:
                lines.append(problem(("planner", "gpu_budget", "total_gpus"),
                                     f"total_gpus ({budget.total_gpus}) is below the GPUs the "
                                     f"pools' min_replicas hold ({floor})", budget.total_gpus))
            if budget.moves and budget.prefill_gpus_per_replica != budget.decode_gpus_per_replica:
                # A move retasks one worker's GPUs; with unequal sizes it would strand GPUs.
                lines.append(problem(("planner", "gpu_budget", "moves"),
                                     "moves need equal GPUs per replica; prefill has "
                                     f"{budget.prefill_gpus_per_replica}, decode has "
                                     f"{budget.decode_gpus_per_replica}", True))
        if sla is not None:
            for name in ("prefill", "decode"):
                if sla.capacity(name) is not None and name not in self.pools():
                    lines.append(problem(("planner", "sla", name), f"sla.{name} is set but "
                                         f"autoscale.{name} is not: the pool is not scaled",
                                         name))
        check(lines)
        return self

    def pools(self) -> dict[str, Any]:
        """The pools the policy scales, by name (``prefill`` first); called by the core."""
        return {n: p for n in ("prefill", "decode")
                if (p := getattr(self.autoscale, n)) is not None}


def parse_planner_policy(data: Any, source: str = "planner policy") -> PlannerPolicy:
    """Validate a decoded document; called by ``load_planner_policy`` and tests.

    A document with only ``autoscale`` and ``planner`` keys is a planner file; any other
    document is a whole policy file (checked by ``parse_policy``), whose ``autoscale``
    section is taken with default planner settings.  Raises ``PolicyError``.
    """
    if not isinstance(data, dict):
        raise PolicyError(source, ["(root): a planner policy must be a mapping"])
    if not set(data) <= PLANNER_KEYS:
        if "planner" in data:
            raise PolicyError(source, [("planner: a `planner` block goes in a planner file "
                                        "holding only `autoscale` and `planner`")])
        policy = parse_policy(data, source)
        if policy.autoscale is None:
            raise PolicyError(source, ["autoscale: the policy file has no autoscale section"])
        return PlannerPolicy(autoscale=policy.autoscale)
    try:
        return PlannerPolicy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, error_lines(exc)) from None


def load_planner_policy(path: Path | str) -> PlannerPolicy:
    """Read a ``.yaml``/``.yml``/``.json`` planner or policy file; raises ``PolicyError``."""
    try:
        data = decode_document(Path(path))
    except DocumentError as exc:
        raise PolicyError(str(path), [f"(root): {exc}"]) from None
    return parse_planner_policy(data, str(path))


def planner_schema() -> dict[str, Any]:
    """The JSON Schema of a planner file, as exported to ``configs/planner/``."""
    schema = PlannerPolicy.model_json_schema()
    schema["title"] = "splitserve planner policy"
    return schema
