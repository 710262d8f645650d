"""Run a sequence of observations through ``decide`` and summarise each decision."""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.planner import (
    Decision,
    Hold,
    Move,
    Observation,
    PlannerPolicy,
    PlannerState,
    decide,
)


def brief(decision: Decision) -> list[str]:
    """``"prefill +1 scale-up"``, ``"decode hold cooldown"``, ``"move decode->prefill 1"``."""
    out = []
    for a in decision.actions:
        if isinstance(a, Move):
            out.append(f"move {a.source}->{a.dest} {a.count}")
        elif isinstance(a, Hold):
            out.append(f"{a.pool} hold {a.reason}")
        else:
            out.append(f"{a.pool} {a.delta:+d} {a.reason}")
    return out


def run(policy: PlannerPolicy, observations: Iterable[Observation],
        state: PlannerState | None = None) -> list[Decision]:
    """Decide each observation in turn, threading the state as the live loop does."""
    state = state or PlannerState()
    decisions = []
    for o in observations:
        d = decide(o, policy, state)
        state = d.state
        decisions.append(d)
    return decisions


def briefs(policy: PlannerPolicy, observations: Iterable[Observation]) -> list[list[str]]:
    """``brief`` of every decision of ``run``."""
    return [brief(d) for d in run(policy, observations)]
