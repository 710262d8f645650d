"""Planner: policy-driven autoscaling of the prefill and decode pools.

The core (``decide``) is pure: an ``Observation`` and the ``PlannerPolicy`` in, a
``Decision`` (actions with reasons, next state, diagnostics) out.  Adapters around it
read metrics (``sources``), act (``connectors``), export metrics (``metrics``) and run
the loop (``loop.Planner``); ``simulate`` replays traces through the same core.
"""

from .config import (
    PlannerPolicy,
    PlannerSettings,
    PoolCapacity,
    SlaSettings,
    load_planner_policy,
    parse_planner_policy,
    planner_schema,
)
from .core import decide
from .model import (
    POOLS,
    Action,
    Decision,
    Hold,
    Move,
    Observation,
    PlannerState,
    PoolDiagnostics,
    PoolObservation,
    PoolState,
    Scale,
)

__all__ = [
    "POOLS", "Action", "Decision", "Hold", "Move", "Observation", "PlannerPolicy",
    "PlannerSettings", "PlannerState", "PoolCapacity", "PoolDiagnostics", "PoolObservation",
    "PoolState", "Scale", "SlaSettings", "decide", "load_planner_policy",
    "parse_planner_policy", "planner_schema",
]
