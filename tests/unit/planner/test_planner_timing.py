"""Table tests of the rules that span intervals: hysteresis and the two cooldowns."""

from __future__ import annotations

import pytest

from splitserve.planner import PlannerState

from .planner_factories import obs, pobs, policy, pool
from .planner_run import briefs, run

pytestmark = pytest.mark.unit

HIGH, MID, LOW = 9.0, 5.0, 0.0   # queue per replica: above up (8), between, below down (2)


def series(*points: tuple[float, int, float]) -> list:
    """Observations of the prefill pool: (time, replicas, queue per replica)."""
    return [obs(t, prefill=pobs(n, queue=q)) for t, n, q in points]


# (case, planner knobs, observations, expected reasons per interval)
CASES = [
    ("up needs 3 intervals", {"hysteresis": {"scale_up_intervals": 3}},
     series((0, 2, HIGH), (10, 2, HIGH), (20, 2, HIGH)),
     ["hold hysteresis", "hold hysteresis", "+1 scale-up"]),
    ("a break resets the up streak", {"hysteresis": {"scale_up_intervals": 2}},
     series((0, 2, HIGH), (10, 2, MID), (20, 2, HIGH), (30, 2, HIGH)),
     ["hold hysteresis", "hold steady", "hold hysteresis", "+1 scale-up"]),
    ("down needs 3 intervals", {"hysteresis": {"scale_down_intervals": 3}},
     series((0, 4, LOW), (10, 4, LOW), (20, 4, LOW)),
     ["hold hysteresis", "hold hysteresis", "-1 scale-down"]),
    ("streak restarts after acting", {"hysteresis": {"scale_up_intervals": 2}},
     series((0, 2, HIGH), (10, 2, HIGH), (20, 3, HIGH), (30, 3, HIGH)),
     ["hold hysteresis", "+1 scale-up", "hold hysteresis", "+1 scale-up"]),
    ("up cooldown", {"cooldown": {"scale_up_s": 30, "scale_down_s": 0}},
     series((0, 2, HIGH), (10, 3, HIGH), (29, 3, HIGH), (30, 3, HIGH)),
     ["+1 scale-up", "hold cooldown", "hold cooldown", "+1 scale-up"]),
    ("down cooldown runs from a scale-up", {"cooldown": {"scale_up_s": 0, "scale_down_s": 60}},
     series((0, 2, HIGH), (10, 3, LOW), (60, 3, LOW)),
     ["+1 scale-up", "hold cooldown", "-1 scale-down"]),
    ("down cooldown runs from a scale-down", {"cooldown": {"scale_up_s": 0, "scale_down_s": 60}},
     series((0, 5, LOW), (30, 4, LOW), (60, 4, LOW)),
     ["-1 scale-down", "hold cooldown", "-1 scale-down"]),
    ("up cooldown ignores scale-downs", {"cooldown": {"scale_up_s": 60, "scale_down_s": 0}},
     series((0, 5, LOW), (10, 4, HIGH)),
     ["-1 scale-down", "+1 scale-up"]),
    ("below-min ignores cooldown and hysteresis",
     {"cooldown": {"scale_up_s": 600}, "hysteresis": {"scale_up_intervals": 5}},
     series((0, 2, HIGH), (10, 0, LOW)),
     ["hold hysteresis", "+1 below-min"]),
]


@pytest.mark.parametrize(("case", "knobs", "seen", "expected"), CASES, ids=[c[0] for c in CASES])
def test_interval_rules(case, knobs, seen, expected):
    p = policy(prefill=pool(min_replicas=1), **knobs)
    got = [b[0].removeprefix("prefill ") for b in briefs(p, seen)]
    assert got == expected


def test_cooldown_detail_says_time_left():
    p = policy(prefill=pool(), cooldown={"scale_up_s": 30, "scale_down_s": 0})
    decisions = run(p, series((0, 2, HIGH), (10, 3, HIGH)))
    assert decisions[1].actions[0].detail.endswith("scale-up cooldown 20s left")


def test_state_is_new_and_records_desired():
    p = policy(prefill=pool())
    start = PlannerState()
    (d,) = run(p, series((5, 2, HIGH)), start)
    assert start == PlannerState()  # the input state is never changed
    ps = d.state.prefill
    assert (ps.desired, ps.last_up_s, ps.last_change_s, ps.up_streak) == (3, 5, 5, 0)
    assert d.state.intervals == 1
