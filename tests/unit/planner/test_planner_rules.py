"""Table tests of one pool's rules: bounds, thresholds per signal, step limits, signals
without readings, and the oscillation guard."""

from __future__ import annotations

import pytest

from splitserve.planner import PlannerState, decide

from .planner_factories import obs, pobs, policy, pool
from .planner_run import briefs

pytestmark = pytest.mark.unit

UTIL = {"up": {"gpu_utilization": 80}, "down": {"gpu_utilization": 40}}
KV = {"up": {"kv_cache_usage": 75}, "down": {"kv_cache_usage": 30}}
SEED_PREFILL = {"up": {"queue_length": 8, "gpu_utilization": 80},
                "down": {"queue_length": 2, "gpu_utilization": 40}}

# (case, pool kwargs, planner knobs, prefill observation, expected actions)
CASES = [
    ("queue at threshold scales up", {}, {}, pobs(2, queue=8), ["prefill +1 scale-up"]),
    ("queue just below holds", {}, {}, pobs(2, queue=7.9), ["prefill hold steady"]),
    ("proportional, capped by max_step", {}, {}, pobs(2, queue=20), ["prefill +2 scale-up"]),
    ("larger max_step lets it through", {}, {"max_step": {"scale_up": 5}}, pobs(2, queue=20),
     ["prefill +3 scale-up"]),
    ("queue at scale_down scales down", {}, {}, pobs(3, queue=2), ["prefill -1 scale-down"]),
    ("between thresholds holds", {}, {}, pobs(3, queue=5), ["prefill hold steady"]),
    ("gpu_utilization up", UTIL, {}, pobs(2, util=80), ["prefill +1 scale-up"]),
    ("gpu_utilization below up", UTIL, {}, pobs(2, util=79), ["prefill hold steady"]),
    ("gpu_utilization down", UTIL, {}, pobs(3, util=20), ["prefill -1 scale-down"]),
    ("gpu_utilization above down", UTIL, {}, pobs(3, util=41), ["prefill hold steady"]),
    ("kv_cache_usage up", KV, {}, pobs(2, kv=90), ["prefill +1 scale-up"]),
    ("kv_cache_usage down", KV, {}, pobs(3, kv=10), ["prefill -1 scale-down"]),
    ("any scale_up signal suffices", SEED_PREFILL, {}, pobs(2, queue=1, util=85),
     ["prefill +1 scale-up"]),
    ("every scale_down signal needed", SEED_PREFILL, {}, pobs(3, queue=1, util=50),
     ["prefill hold steady"]),
    ("every scale_down signal low", SEED_PREFILL, {}, pobs(3, queue=1, util=30),
     ["prefill -1 scale-down"]),
    ("unread signal ignored", SEED_PREFILL, {}, pobs(3, queue=1), ["prefill -1 scale-down"]),
    ("unread signal holds", SEED_PREFILL, {"unknown_signals": "hold"}, pobs(3, queue=1),
     ["prefill hold steady"]),
    ("nothing read holds", SEED_PREFILL, {}, pobs(3), ["prefill hold steady"]),
    ("below min goes to min at once", {"min_replicas": 3}, {}, pobs(0, queue=0),
     ["prefill +3 below-min"]),
    ("above max goes to max at once", {"max_replicas": 4}, {}, pobs(7, queue=0),
     ["prefill -3 above-max"]),
    ("at max holds", {"max_replicas": 4}, {}, pobs(4, queue=30), ["prefill hold at-max"]),
    ("at min holds", {"min_replicas": 2}, {}, pobs(2, queue=0), ["prefill hold at-min"]),
    ("up stops at max", {"max_replicas": 3}, {}, pobs(2, queue=30), ["prefill +1 scale-up"]),
    ("max_step down", {}, {"max_step": {"scale_down": 3}}, pobs(6, queue=0),
     ["prefill -3 scale-down"]),
    ("down stops at min", {"min_replicas": 5}, {"max_step": {"scale_down": 3}},
     pobs(6, queue=0), ["prefill -1 scale-down"]),
    ("from zero replicas", {"min_replicas": 0}, {}, pobs(0, queue=9), ["prefill +1 scale-up"]),
]


@pytest.mark.parametrize(("case", "pool_kw", "knobs", "seen", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_single_interval_rules(case, pool_kw, knobs, seen, expected):
    p = policy(prefill=pool(**pool_kw), **knobs)
    assert briefs(p, [obs(0, prefill=seen)]) == [expected]


# Guard: down threshold 5 and up threshold 8 on the queue per replica.
GUARD = {"up": {"queue_length": 8}, "down": {"queue_length": 5}}
GUARD_CASES = [
    ("2 -> 1 would double 4.5 to 9", {}, pobs(2, queue=4.5), ["prefill hold oscillation-guard"]),
    ("guard off removes anyway", {"oscillation_guard": False}, pobs(2, queue=4.5),
     ["prefill -1 scale-down"]),
    ("4 -> 3 projects 6: allowed", {}, pobs(4, queue=4.5), ["prefill -1 scale-down"]),
    ("step 2 trimmed to what the guard allows", {"max_step": {"scale_down": 2}},
     pobs(4, queue=4.5), ["prefill -1 scale-down"]),
    ("step 2 allowed when load is light", {"max_step": {"scale_down": 2}}, pobs(4, queue=1),
     ["prefill -2 scale-down"]),
    ("a scale_up-only signal is projected too", {}, pobs(3, queue=1, util=60),
     ["prefill hold oscillation-guard"]),
]


@pytest.mark.parametrize(("case", "knobs", "seen", "expected"), GUARD_CASES,
                         ids=[c[0] for c in GUARD_CASES])
def test_oscillation_guard(case, knobs, seen, expected):
    up = {**GUARD["up"], "gpu_utilization": 80}
    p = policy(prefill=pool(min_replicas=1, up=up, down=GUARD["down"]), **knobs)
    assert briefs(p, [obs(0, prefill=seen)]) == [expected]


def test_guard_detail_shows_projection():
    p = policy(prefill=pool(up=GUARD["up"], down=GUARD["down"]))
    hold = decide(obs(0, prefill=pobs(2, queue=4.5)), p, PlannerState()).actions[0]
    assert hold.reason == "oscillation-guard"
    assert "4.5x2/1=9" in hold.detail and "scale_up 8" in hold.detail


def test_unobserved_pool_holds_with_no_data():
    p = policy(prefill=pool(), decode=pool())
    assert briefs(p, [obs(0, prefill=pobs(2, queue=9))]) == [
        ["prefill +1 scale-up", "decode hold no-data"]]


def test_pool_not_in_policy_is_left_alone():
    p = policy(decode=pool())
    assert briefs(p, [obs(0, prefill=pobs(2, queue=50), decode=pobs(2, queue=0))]) == [
        ["decode -1 scale-down"]]


def test_diagnostics_carry_the_readings():
    p = policy(prefill=pool(**SEED_PREFILL))
    d = decide(obs(0, prefill=pobs(3, queue=9, util=50)), p, PlannerState())
    diag = d.diagnostics["prefill"]
    assert diag.signals == {"gpu_utilization": 50, "queue_length": 9}
    assert diag.tripped_up == ("queue_length",) and not diag.down_ok
    assert diag.proposed == 4 and diag.pressure == pytest.approx(9 / 8)
