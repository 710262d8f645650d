"""Replay a trace through the planner core against a modelled fleet.

``simulate`` steps a ``FleetSim`` one planner interval at a time, hands each interval's
observation to ``decide`` — the same function the live planner calls — and applies the
actions to the model.  ``render_table`` prints what the planner would have done and when.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .config import PlannerPolicy
from .core import decide
from .fleet import FleetModel, FleetSim
from .model import Decision, Hold, Move, Observation, PlannerState, Scale
from .traces import TraceRequest


@dataclass(frozen=True)
class SimResult:
    """Every interval's observation and decision, in order."""

    interval_s: float
    observations: list[Observation]
    decisions: list[Decision]

    def summary(self) -> dict[str, Any]:
        """Totals: actions by kind, replica range per pool, mean TTFT, replica-seconds."""
        changes = [a for d in self.decisions for a in d.changes()]
        ttfts = [o.ttft_s for o in self.observations if o.ttft_s is not None]
        out: dict[str, Any] = {
            "intervals": len(self.decisions),
            "scale_up": sum(isinstance(a, Scale) and a.delta > 0 for a in changes),
            "scale_down": sum(isinstance(a, Scale) and a.delta < 0 for a in changes),
            "moves": sum(isinstance(a, Move) for a in changes),
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        }
        for pool in ("prefill", "decode"):
            seen = [p.replicas for o in self.observations if (p := o.pool(pool)) is not None]
            if seen:
                out[f"{pool}_replicas"] = {"min": min(seen), "max": max(seen)}
                out[f"{pool}_replica_seconds"] = sum(seen) * self.interval_s
        return out


def _initial(model: FleetModel, policy: PlannerPolicy, pool: str) -> int:
    given = model.prefill_replicas if pool == "prefill" else model.decode_replicas
    if given is not None:
        return given
    cfg = policy.pools().get(pool)
    return cfg.min_replicas if cfg is not None else 1


def simulate(trace: Sequence[TraceRequest], policy: PlannerPolicy, model: FleetModel,
             interval_s: float | None = None, duration_s: float | None = None) -> SimResult:
    """Replay ``trace`` (sorted by arrival) for ``duration_s`` (default: to the last
    arrival); returns every interval's observation and decision."""
    dt = interval_s or policy.planner.interval_s
    if duration_s is not None:
        steps = max(1, math.ceil(duration_s / dt - 1e-9))
    else:  # through the interval holding the last arrival
        steps = math.floor((trace[-1].arrival_s if trace else 0.0) / dt) + 1
    fleet = FleetSim(model, [0.0] * _initial(model, policy, "prefill"),
                     [0.0] * _initial(model, policy, "decode"))
    state, nxt = PlannerState(), 0
    observations, decisions = [], []
    for i in range(steps):
        t0 = i * dt
        start = nxt
        while nxt < len(trace) and trace[nxt].arrival_s < t0 + dt:
            nxt += 1
        obs = fleet.step(t0, dt, list(trace[start:nxt]))
        decision = decide(obs, policy, state)
        fleet.apply(decision.changes(), obs.time_s)
        state = decision.state
        observations.append(obs)
        decisions.append(decision)
    return SimResult(dt, observations, decisions)


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _action(decision: Decision) -> tuple[str, str]:
    changes = decision.changes()
    if not changes:
        holds = [a for a in decision.actions if isinstance(a, Hold)
                 and a.reason not in ("steady", "at-min")]
        return "-", " ".join(f"{a.pool}:{a.reason}" for a in holds) or "steady"
    what, why = [], []
    for a in changes:
        if isinstance(a, Move):
            what.append(f"move {a.source}->{a.dest} x{a.count}")
        else:
            assert isinstance(a, Scale)
            what.append(f"{a.pool} {a.delta:+d}->{a.target}")
        why.append(f"{a.reason}: {a.detail}")
    return "; ".join(what), " | ".join(why)


def rows(result: SimResult) -> list[dict[str, Any]]:
    """One JSON-able row per interval: observation, actions and reasons."""
    out = []
    for obs, decision in zip(result.observations, result.decisions, strict=True):
        row = {"time_s": obs.time_s, "observation": asdict(obs),
               "actions": [asdict(a) for a in decision.actions]}
        out.append(row)
    return out


def render_table(result: SimResult, changes_only: bool = False) -> str:
    """A fixed-width table: interval end, per-pool replicas/queue/utilisation, action."""
    head = (f"{'t(s)':>7} {'P rep':>5} {'P q/r':>6} {'P util':>6} {'D rep':>5} {'D q/r':>6} "
            f"{'D kv%':>6} {'D util':>6} {'TTFT s':>7}  {'action':<24} reason")
    lines = [head, "-" * len(head)]
    for obs, decision in zip(result.observations, result.decisions, strict=True):
        what, why = _action(decision)
        if changes_only and what == "-":
            continue
        p, d = obs.prefill, obs.decode
        lines.append(
            f"{obs.time_s:>7.0f} {p.replicas if p else '-':>5} "
            f"{_num(p.queue_length if p else None):>6} "
            f"{_num(p.gpu_utilization if p else None, '.0f'):>6} "
            f"{d.replicas if d else '-':>5} {_num(d.queue_length if d else None):>6} "
            f"{_num(d.kv_cache_usage if d else None, '.0f'):>6} "
            f"{_num(d.gpu_utilization if d else None, '.0f'):>6} "
            f"{_num(obs.ttft_s, '.2f'):>7}  {what:<24} {why}")
    return "\n".join(lines)
