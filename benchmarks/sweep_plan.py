"""Load points of a goodput sweep in multiples of the fleet's capacity (pure functions).

A sweep offers the trace at ``multiple × capacity_rps`` for each multiple: the trace's
arrival times are compressed by a rate scale chosen so that the replayed window offers
that rate, and the window is long enough to last ``window_s`` of wall time at it (the
top rates get ``sustained_s``, so a saturated system has to hold the load for a while
rather than absorb a short burst in its queues).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPoint:
    """One load of the sweep: offer ``target_rps`` for ``window_s`` wall seconds by
    replaying the trace's ``[0, duration_trace_s)`` seconds ``rate_scale`` times faster."""

    multiple: float
    target_rps: float
    rate_scale: float
    window_s: float
    duration_trace_s: float


def parse_multiples(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``; each must be > 0."""
    out = [float(p) for p in text.split(",") if p.strip()]
    if not out or any(not m > 0 for m in out):
        raise ValueError(f"capacity multiples must be > 0, got {text!r}")
    return out


def offered_rps(arrivals_s: list[float], duration_trace_s: float, rate_scale: float) -> float:
    """The rate a replay of ``[0, duration_trace_s)`` offers at ``rate_scale``: requests
    over the span from the first to the last arrival, as the replay measures it."""
    n = bisect.bisect_left(arrivals_s, duration_trace_s)
    if n < 2:
        return 0.0
    span = (arrivals_s[n - 1] - arrivals_s[0]) / rate_scale
    return n / span if span > 0 else 0.0


def plan_loads(arrivals_s: list[float], capacity_rps: float, multiples: list[float],
               window_s: float, sustained_s: float, sustained_from: float) -> list[LoadPoint]:
    """The sweep's load points, from sorted trace arrival times (seconds from its start).

    Multiples at or above ``sustained_from`` last ``sustained_s``, the others
    ``window_s``.  The rate scale is found by fixed-point iteration (the window's own
    request rate depends on how much of the trace it covers).  Raises ValueError when
    the trace is too short to sustain a point.
    """
    if capacity_rps <= 0 or window_s <= 0 or sustained_s <= 0:
        raise ValueError("capacity and windows must be > 0")
    total = arrivals_s[-1] - arrivals_s[0]
    mean_rps = len(arrivals_s) / total
    points = []
    for m in multiples:
        target = m * capacity_rps
        wall = sustained_s if m >= sustained_from else window_s
        scale = target / mean_rps
        for _ in range(8):
            rate = offered_rps(arrivals_s, wall * scale, scale)
            if rate <= 0:
                break
            scale *= target / rate
        duration = wall * scale
        if duration > total:
            raise ValueError(f"{m:g}x capacity for {wall:g}s needs {duration:.0f}s of trace; "
                             f"it has {total:.0f}s")
        points.append(LoadPoint(m, target, scale, wall, duration))
    return points


def _at(points: list[dict], config: str, multiple: float) -> dict | None:
    return next((p for p in points if p["config"] == config
                 and p.get("capacity_multiple") == multiple), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def goals(points: list[dict], ours: str, ref: str, saturated: float = 2.0,
          below: float = 1.0) -> list[dict]:
    """The sweep's goals, one row per goal and load, as data.

    Past saturation (``saturated`` × capacity) our goodput must be >= 1.5x ``ref``'s; at
    and below ``below`` × capacity >= 1.0x, with TTFT and TPOT p99 within 1.2x of
    ``ref``'s.  ``met`` is None where a figure is missing (a point failed)."""
    rows = []
    multiples = sorted({p["capacity_multiple"] for p in points
                        if p.get("capacity_multiple") is not None})
    for m in multiples:
        a, b = _at(points, ours, m), _at(points, ref, m)
        if a is None or b is None:
            continue
        checks = []
        if m == saturated:
            checks.append(("goodput", "goodput_rps", 1.5, True))
        if m <= below:
            checks += [("goodput", "goodput_rps", 1.0, True),
                       ("TTFT p99", "ttft_p99_ms", 1.2, False),
                       ("TPOT p99", "tpot_p99_ms", 1.2, False)]
        for what, key, bound, at_least in checks:
            r = _ratio(a.get(key), b.get(key))
            met = None if r is None else (r >= bound if at_least else r <= bound)
            rows.append({"multiple": m, "what": what, "ours": a.get(key), "ref": b.get(key),
                         "ratio": r, "goal": f"{'>=' if at_least else '<='} {bound:g}x",
                         "met": met})
    return rows


def markdown_goals(rows: list[dict], ours: str, ref: str) -> str:
    """The goal rows as a markdown table."""
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"
    out = [f"| load | measure | {ours} | {ref} | ratio | goal | met? |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "?" if r["met"] is None else ("yes" if r["met"] else "**no**")
        out.append(f"| {r['multiple']:g}x | {r['what']} | {f(r['ours'])} | {f(r['ref'])} | "
                   f"{f(r['ratio'])} | {r['goal']} | {met} |")
    return "\n".join(out)
