"""Table tests of the GPU budget: partial scale-ups, holds, moves between roles, order."""

from __future__ import annotations

import pytest

from .planner_factories import obs, pobs, policy, pool
from .planner_run import briefs, run

pytestmark = pytest.mark.unit

HIGH, MID, LOW = 9.0, 5.0, 0.0


def budget(total: int, moves: bool = True, prefill_gpus: int = 1, decode_gpus: int = 1,
           **knobs) -> dict:
    return {"gpu_budget": {"total_gpus": total, "moves": moves,
                           "prefill_gpus_per_replica": prefill_gpus,
                           "decode_gpus_per_replica": decode_gpus}, **knobs}


# (case, planner knobs, (prefill replicas, queue), (decode replicas, queue), expected)
CASES = [
    ("room in the budget", budget(6), (2, HIGH), (2, MID), ["prefill +1 scale-up",
                                                            "decode hold steady"]),
    ("budget allows part of the step", budget(6), (2, 20.0), (3, MID),
     ["prefill +1 scale-up", "decode hold steady"]),
    ("budget spent, other pool busy", budget(6), (3, HIGH), (3, MID),
     ["prefill hold budget", "decode hold steady"]),
    ("budget spent, other pool idle: move", budget(6), (3, HIGH), (3, LOW),
     ["move decode->prefill 1"]),
    ("moves off: scale down, hold up", budget(6, moves=False), (3, HIGH), (3, LOW),
     ["decode -1 scale-down", "prefill hold budget"]),
    ("move toward decode", budget(6), (3, LOW), (3, HIGH), ["move prefill->decode 1"]),
    ("move limited by the donor's step", budget(6), (2, 30.0), (4, LOW),
     ["move decode->prefill 1"]),
    ("move of two when both steps allow", budget(6, max_step={"scale_down": 2}), (2, 30.0),
     (4, LOW), ["move decode->prefill 2"]),
    ("no move when the donor is at min", budget(4), (2, HIGH), (2, LOW),
     ["prefill hold budget", "decode hold at-min"]),
    ("higher pressure first", budget(5), (2, 12.0), (2, HIGH),
     ["prefill +1 scale-up", "decode hold budget"]),
    ("higher pressure first, other way", budget(5), (2, HIGH), (2, 12.0),
     ["decode +1 scale-up", "prefill hold budget"]),
    ("replica needs more GPUs than are free", budget(8, moves=False, prefill_gpus=2),
     (2, HIGH), (3, MID), ["prefill hold budget", "decode hold steady"]),
    ("replica sizes count in the budget", budget(8, moves=False, prefill_gpus=2),
     (2, HIGH), (2, MID), ["prefill +1 scale-up", "decode hold steady"]),
]


@pytest.mark.parametrize(("case", "knobs", "pre", "dec", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_budget(case, knobs, pre, dec, expected):
    p = policy(prefill=pool(min_replicas=2), decode=pool(min_replicas=2), **knobs)
    seen = obs(0, prefill=pobs(pre[0], queue=pre[1]), decode=pobs(dec[0], queue=dec[1]))
    assert briefs(p, [seen]) == [expected]


def test_move_targets_detail_and_state():
    p = policy(prefill=pool(), decode=pool(), **budget(6))
    (d,) = run(p, [obs(7, prefill=pobs(3, queue=HIGH), decode=pobs(3, queue=LOW))])
    (move,) = d.actions
    assert (move.source_target, move.dest_target) == (2, 4)
    assert move.detail.startswith("GPU budget spent (6/6)")
    assert d.state.prefill.last_up_s == 7 and d.state.prefill.desired == 4
    assert d.state.decode.last_change_s == 7 and d.state.decode.last_up_s is None
    assert d.state.decode.desired == 2


def test_budget_unknown_when_a_pool_is_unobserved():
    p = policy(prefill=pool(), decode=pool(), **budget(6))
    (d,) = run(p, [obs(0, prefill=pobs(2, queue=HIGH))])
    assert [(a.pool, a.reason) for a in d.actions] == [("prefill", "budget"),
                                                       ("decode", "no-data")]
    assert d.actions[0].detail.endswith("replicas of decode unknown")


def test_releases_come_before_claims():
    p = policy(prefill=pool(), decode=pool())
    seen = obs(0, prefill=pobs(2, queue=HIGH), decode=pobs(3, queue=LOW))
    assert briefs(p, [seen]) == [["decode -1 scale-down", "prefill +1 scale-up"]]
