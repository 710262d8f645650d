"""One pool's reading of its rules: what it would do on its own, before the GPU budget.

Called by ``core.decide`` once per pool per interval.  Order of the gates (the first that
applies wins): replica bounds, then the wish to grow (threshold signals, SLA sizing,
latency breach) through hysteresis, cooldown and the step limit, then the wish to
shrink through hysteresis, cooldown, the step limit and the oscillation guard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from splitserve.components.policy.sections import PoolAutoscale

from . import sla as sla_math
from .config import PlannerSettings
from .model import Observation, PoolDiagnostics, PoolObservation, PoolState

Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class Proposal:
    """A pool's own wish: ``target`` replicas (== ``replicas`` when holding)."""

    pool: str
    replicas: int
    target: int
    direction: Direction
    reason: str
    detail: str
    pressure: float = 0.0


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in values.items())


def tripped_up(cfg: PoolAutoscale, obs: PoolObservation) -> dict[str, float]:
    """The scale_up signals at or above their thresholds, with their readings."""
    out = {}
    for name, threshold in cfg.scale_up.signals().items():
        value = obs.signal(name)
        if value is not None and value >= threshold:
            out[name] = value
    return out


def down_holds(cfg: PoolAutoscale, obs: PoolObservation, unknown: str) -> tuple[bool, str]:
    """Whether every scale_down signal is at or below its threshold, and why not.

    Unread signals are skipped (``unknown="ignore"``, but one reading is still needed)
    or block the scale-down (``"hold"``).
    """
    named = cfg.scale_down.signals()
    read = {n: v for n in named if (v := obs.signal(n)) is not None}
    missing = sorted(set(named) - set(read))
    if missing and unknown == "hold":
        return False, f"no reading of {', '.join(missing)}"
    if not read:
        return False, "no reading of any scale_down signal"
    above = {n: v for n, v in read.items() if v > named[n]}
    if above:
        return False, f"above scale_down: {_fmt(above)}"
    return True, f"at or below scale_down: {_fmt(read)}"


def pressure(cfg: PoolAutoscale, obs: PoolObservation) -> float:
    """Highest reading / scale_up threshold: which pool needs capacity most."""
    ratios = [v / t if t > 0 else math.inf
              for n, t in cfg.scale_up.signals().items() if (v := obs.signal(n)) is not None]
    return max(ratios, default=0.0)


def threshold_target(replicas: int, cfg: PoolAutoscale, tripped: dict[str, float]) -> int:
    """Replicas that bring every tripped signal back to its threshold, at least one more.

    Per-replica signals scale as 1/replicas, so ``ceil(n * value / threshold)`` (the
    Kubernetes HPA rule); the step limit caps it later.
    """
    thresholds = cfg.scale_up.signals()
    want = [math.ceil(replicas * v / thresholds[n]) if thresholds[n] > 0 else replicas + 1
            for n, v in tripped.items()]
    return max([replicas + 1, *want])


def removable(replicas: int, wanted: int, cfg: PoolAutoscale, obs: PoolObservation,
              guard: bool) -> tuple[int, str]:
    """How many replicas (up to ``wanted``) can go without reaching a scale_up threshold.

    The oscillation guard projects each per-replica reading onto the replicas left,
    ``value * n / (n - k)``, and refuses a removal that would trip scale_up at once.
    """
    wanted = min(wanted, replicas - cfg.min_replicas)
    if not guard:
        return max(wanted, 0), ""
    thresholds = cfg.scale_up.signals()
    refused = ""
    for k in range(wanted, 0, -1):
        left = replicas - k
        crossing = {}
        for name, threshold in thresholds.items():
            value = obs.signal(name)
            if value is None:
                continue
            projected = value * replicas / left if left else (math.inf if value > 0 else 0.0)
            if projected >= threshold:
                crossing[name] = (value, projected, threshold)
        if not crossing:
            return k, ""
        name, (value, projected, threshold) = next(iter(crossing.items()))
        refused = (f"{name} {value:.3g}x{replicas}/{left}={projected:.3g} would reach "
                   f"scale_up {threshold:g}")
    return 0, refused


def _since(now: float, then: float | None) -> float:
    return math.inf if then is None else now - then


@dataclass(frozen=True)
class _Targets:
    """What one pool's signals ask for before the gates (hysteresis, cooldown, bounds)."""

    up: int | None
    up_reason: str
    up_why: str
    down: int | None
    down_ok: bool
    down_why: str
    tripped: dict[str, float]
    history: tuple
    predicted: float | None
    sla_n: int | None


def _targets(pool: str, cfg: PoolAutoscale, obs: PoolObservation, observation: Observation,
             state: PoolState, settings: PlannerSettings) -> _Targets:
    """Up and down targets from the thresholds, the SLA sizing and latency breaches."""
    n = obs.replicas
    tripped = tripped_up(cfg, obs)
    down_ok, down_why = down_holds(cfg, obs, settings.unknown_signals)
    up_target = threshold_target(n, cfg, tripped) if tripped else None
    up_why = f"scale_up reached: {_fmt(tripped)}" if tripped else ""
    up_reason = "scale-up"
    history, predicted, sla_n = state.load_history, None, None
    sla = settings.sla
    capacity = sla.capacity(pool) if sla else None
    if sla is not None and capacity is not None:
        history = sla_math.remember(history, sla_math.pool_load(observation, pool, capacity),
                                    sla.window)
        predicted = sla_math.predict(history, sla.predictor, sla.window)
        if predicted is not None:
            # Not capped at max_replicas: the at-max gate reports the shortfall.
            sla_n = max(sla_math.replicas_needed(predicted, capacity), cfg.min_replicas)
            if sla_n > n and (up_target is None or sla_n > up_target):
                up_target, up_reason = sla_n, "sla"
                up_why = f"predicted load {predicted:.4g} needs {sla_n}"
    breach = sla_math.latency_breach(observation, pool, sla) if sla else None
    if breach and (up_target is None or up_target < n + 1):
        up_target, up_why, up_reason = n + 1, breach, "latency"
    # With SLA sizing, shrinking needs the prediction to agree with the thresholds.
    down_target = None
    if down_ok and up_target is None and (sla_n is None or sla_n < n):
        down_target = cfg.min_replicas if sla_n is None else sla_n
    return _Targets(up_target, up_reason, up_why, down_target, down_ok, down_why, tripped,
                    history, predicted, sla_n)


def evaluate(pool: str, cfg: PoolAutoscale, obs: PoolObservation, observation: Observation,
             state: PoolState, settings: PlannerSettings
             ) -> tuple[Proposal, PoolState, PoolDiagnostics]:
    """Read one pool: its proposal, its next state (streaks, load history), diagnostics."""
    n = obs.replicas
    t = _targets(pool, cfg, obs, observation, state, settings)
    streak_up = state.up_streak + 1 if t.up is not None else 0
    streak_down = state.down_streak + 1 if t.down is not None else 0
    new_state = replace(state, up_streak=streak_up, down_streak=streak_down,
                        load_history=t.history)
    p = pressure(cfg, obs)
    if n < cfg.min_replicas:
        prop = Proposal(pool, n, cfg.min_replicas, "up", "below-min",
                        f"{n} < min_replicas {cfg.min_replicas}", math.inf)
    elif n > cfg.max_replicas:
        prop = Proposal(pool, n, cfg.max_replicas, "down", "above-max",
                        f"{n} > max_replicas {cfg.max_replicas}")
    elif t.up is not None:
        prop = _gate_up(pool, cfg, n, t, streak_up, observation.time_s, state, settings, p)
    elif t.down is not None:
        prop = _gate_down(pool, cfg, obs, t, streak_down, observation.time_s, state, settings,
                          p)
    else:
        sized = (f"predicted load {t.predicted:.4g} needs {t.sla_n}" if t.sla_n is not None
                 else "no signal past a threshold")
        prop = Proposal(pool, n, n, "hold", "steady", t.down_why if not t.down_ok else sized,
                        p)
    diag = PoolDiagnostics(
        pool=pool, replicas=n,
        signals={s: obs.signal(s)
                 for s in sorted({*cfg.scale_up.signals(), *cfg.scale_down.signals()})},
        tripped_up=tuple(sorted(t.tripped)), down_ok=t.down_ok, up_streak=streak_up,
        down_streak=streak_down, predicted_load=t.predicted, sla_replicas=t.sla_n,
        proposed=prop.target, pressure=p)
    return prop, new_state, diag


def _gate_up(pool: str, cfg: PoolAutoscale, n: int, t: _Targets, streak: int, now: float,
             state: PoolState, settings: PlannerSettings, p: float) -> Proposal:
    """A scale-up the signals ask for, unless at max, in hysteresis or cooling down."""
    hyst = settings.hysteresis
    wait_s = settings.cooldown.scale_up_s - _since(now, state.last_up_s)
    if n >= cfg.max_replicas:
        return Proposal(pool, n, n, "hold", "at-max",
                        f"{t.up_why}; already at max_replicas {cfg.max_replicas}", p)
    if streak < hyst.scale_up_intervals:
        return Proposal(pool, n, n, "hold", "hysteresis",
                        f"{t.up_why} ({streak}/{hyst.scale_up_intervals} intervals)", p)
    if wait_s > 0:
        return Proposal(pool, n, n, "hold", "cooldown",
                        f"{t.up_why}; scale-up cooldown {wait_s:.0f}s left", p)
    target = min(t.up, cfg.max_replicas, n + settings.max_step.scale_up)
    return Proposal(pool, n, target, "up", t.up_reason, t.up_why, max(p, 1.0))


def _gate_down(pool: str, cfg: PoolAutoscale, obs: PoolObservation, t: _Targets, streak: int,
               now: float, state: PoolState, settings: PlannerSettings, p: float) -> Proposal:
    """A scale-down the signals allow, unless at min, in hysteresis, cooling down or
    refused by the oscillation guard."""
    n, hyst = obs.replicas, settings.hysteresis
    wait_s = settings.cooldown.scale_down_s - _since(now, state.last_change_s)
    k, refused = removable(n, min(settings.max_step.scale_down, n - t.down), cfg, obs,
                           settings.oscillation_guard)
    if n <= cfg.min_replicas:
        return Proposal(pool, n, n, "hold", "at-min",
                        f"{t.down_why}; already at min_replicas {cfg.min_replicas}", p)
    if streak < hyst.scale_down_intervals:
        return Proposal(pool, n, n, "hold", "hysteresis",
                        f"{t.down_why} ({streak}/{hyst.scale_down_intervals} intervals)", p)
    if wait_s > 0:
        return Proposal(pool, n, n, "hold", "cooldown",
                        f"{t.down_why}; scale-down cooldown {wait_s:.0f}s left", p)
    if k == 0:
        return Proposal(pool, n, n, "hold", "oscillation-guard", refused, p)
    reason = "sla" if t.sla_n is not None else "scale-down"
    why = (f"predicted load {t.predicted:.4g} needs {t.sla_n}; {t.down_why}"
           if t.sla_n is not None else t.down_why)
    return Proposal(pool, n, n - k, "down", reason, why, p)
