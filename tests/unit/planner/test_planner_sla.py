"""SLA mode: predictors, sizing arithmetic, and how sizing combines with the thresholds."""

from __future__ import annotations

import pytest

from splitserve.planner import PoolCapacity
from splitserve.planner.sla import (
    latency_breach,
    pool_load,
    predict,
    remember,
    replicas_needed,
)

from .planner_factories import obs, pobs, policy, pool
from .planner_run import briefs

pytestmark = pytest.mark.unit

PREDICT = [
    ("constant", [1.0, 2.0, 3.0], 3, 3.0),
    ("moving-average", [1.0, 2.0, 3.0], 2, 2.5),
    ("moving-average", [1.0, 2.0, 3.0], 10, 2.0),
    ("moving-average", [4.0], 6, 4.0),
    ("linear-trend", [1.0, 2.0, 3.0], 3, 4.0),
    ("linear-trend", [0.0, 10.0, 1.0, 2.0, 3.0], 3, 4.0),
    ("linear-trend", [3.0, 2.0, 1.0], 3, 0.0),
    ("linear-trend", [6.0, 4.0], 2, 2.0),
    ("linear-trend", [2.0, 2.0, 2.0], 3, 2.0),
    ("linear-trend", [5.0], 3, 5.0),
]


@pytest.mark.parametrize(("predictor", "history", "window", "expected"), PREDICT)
def test_predictors(predictor, history, window, expected):
    assert predict(history, predictor, window) == pytest.approx(expected)


def test_no_history_predicts_nothing():
    assert predict([], "constant", 3) is None


NEEDED = [
    (0.0, {"tokens_per_s": 100}, 0),
    (100.0, {"tokens_per_s": 100}, 1),
    (100.5, {"tokens_per_s": 100}, 2),
    (250.0, {"tokens_per_s": 100}, 3),
    (0.3, {"requests_per_s": 0.1}, 3),                    # 2.9999999999999996 replicas
    (0.1 + 0.2, {"requests_per_s": 0.1}, 3),              # 3.0000000000000004 replicas
]


@pytest.mark.parametrize(("load", "capacity", "expected"), NEEDED)
def test_replicas_needed(load, capacity, expected):
    assert replicas_needed(load, PoolCapacity(**capacity)) == expected


def test_pool_load_picks_the_capacity_unit():
    o = obs(0, requests_per_s=2.0, prompt_tokens_per_s=5000.0, output_tokens_per_s=300.0)
    tokens, requests = PoolCapacity(tokens_per_s=1), PoolCapacity(requests_per_s=1)
    assert pool_load(o, "prefill", tokens) == 5000.0
    assert pool_load(o, "decode", tokens) == 300.0
    assert pool_load(o, "decode", requests) == 2.0


def test_latency_breach_and_remember():
    sla = policy(prefill=pool(), sla={"ttft_s": 2.0, "itl_s": 0.05}).planner.sla
    assert latency_breach(obs(0, ttft_s=3.0), "prefill", sla) == "ttft 3s > target 2s"
    assert latency_breach(obs(0, ttft_s=2.0), "prefill", sla) is None
    assert latency_breach(obs(0, itl_s=0.06), "decode", sla) == "itl 0.06s > target 0.05s"
    assert latency_breach(obs(0), "decode", sla) is None
    assert remember((1.0, 2.0, 3.0), 4.0, 3) == (2.0, 3.0, 4.0)
    assert remember((1.0,), None, 3) == (1.0,)


HIGH, MID, LOW = 9.0, 5.0, 0.0


def sla_policy(predictor: str = "constant", window: int = 3, **sla):
    return policy(prefill=pool(min_replicas=1, max_replicas=6),
                  max_step={"scale_up": 2, "scale_down": 1},
                  sla={"predictor": predictor, "window": window,
                       "prefill": {"tokens_per_s": 1000}, **sla})


def seen(t, n, queue, tokens, **kw):
    return obs(t, prefill=pobs(n, queue=queue), prompt_tokens_per_s=tokens, **kw)


# (case, policy, observations, expected reasons of the last interval)
CASES = [
    ("predicted load needs more", sla_policy(), [seen(0, 2, MID, 3500)], "+2 sla"),
    ("predicted load needs fewer", sla_policy(), [seen(0, 5, LOW, 1500)], "-1 sla"),
    ("fewer, but the queue is not low", sla_policy(), [seen(0, 5, MID, 1500)], "hold steady"),
    ("enough, but a threshold trips", sla_policy(), [seen(0, 3, HIGH, 1000)], "+1 scale-up"),
    ("sized right", sla_policy(), [seen(0, 3, LOW, 2500)], "hold steady"),
    ("clamped to max_replicas", sla_policy(), [seen(0, 6, MID, 90000)], "hold at-max"),
    ("moving average smooths a burst", sla_policy("moving-average"),
     [seen(0, 3, MID, 1000), seen(10, 3, MID, 1000), seen(20, 3, MID, 7000)], "hold steady"),
    ("constant follows the burst", sla_policy("constant"),
     [seen(0, 3, MID, 1000), seen(10, 3, MID, 1000), seen(20, 3, MID, 7000)], "+2 sla"),
    ("linear trend anticipates", sla_policy("linear-trend"),
     [seen(0, 3, MID, 1000), seen(10, 3, MID, 2000), seen(20, 3, MID, 3000)], "+1 sla"),
    ("TTFT over target asks for one more", sla_policy(ttft_s=2.0),
     [seen(0, 3, MID, 1000, ttft_s=3.0)], "+1 latency"),
    ("no load reading: thresholds only", sla_policy(), [seen(0, 3, LOW, None)],
     "-1 scale-down"),
]


@pytest.mark.parametrize(("case", "pol", "observations", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_sla_decisions(case, pol, observations, expected):
    last = briefs(pol, observations)[-1]
    assert last == [f"prefill {expected}"]


def test_sla_diagnostics_and_history():
    from splitserve.planner import PlannerState, decide

    d = decide(seen(0, 2, MID, 3500), sla_policy(), PlannerState())
    diag = d.diagnostics["prefill"]
    assert (diag.predicted_load, diag.sla_replicas) == (3500, 4)
    assert d.state.prefill.load_history == (3500,)
    assert d.actions[0].detail == "predicted load 3500 needs 4"
