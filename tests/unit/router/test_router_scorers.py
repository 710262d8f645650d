"""Table tests of the built-in scorers, including the seed's latency-cost ordering."""

from __future__ import annotations

import pytest
from splitserve.components.router.plugins import (
    kv_overlap,
    latency_cost,
    least_requests,
    round_robin,
)
from splitserve.components.router.plugins.normalise import invert_min_max

from .router_factories import config, request, router, snapshot, worker

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("costs", "expected"), [
    ({1: 0.0, 2: 5.0, 3: 10.0}, {1: 1.0, 2: 0.5, 3: 0.0}),
    ({1: 7.0, 2: 7.0}, {1: 1.0, 2: 1.0}),
    ({1: -3.0}, {1: 1.0}),
    ({}, {}),
])
def test_invert_min_max(costs, expected):
    assert invert_min_max(costs) == pytest.approx(expected)


@pytest.mark.parametrize(("loads", "expected"), [
    ([(0, 0), (2, 2), (8, 0)], {1: 1.0, 2: 0.5, 3: 0.0}),
    ([(3, 1), (1, 3)], {1: 1.0, 2: 1.0}),
])
def test_least_requests_scorer(loads, expected):
    workers = [worker(i + 1, active_requests=a, waiting_requests=w)
               for i, (a, w) in enumerate(loads)]
    scorer = least_requests.LeastRequestsScorer(least_requests.Params())
    assert scorer.score(request(), snapshot(*workers), workers) == pytest.approx(expected)


@pytest.mark.parametrize(("num_blocks", "overlap", "expected"), [
    (10, {1: 10, 2: 5}, {1: 1.0, 2: 0.5, 3: 0.0}),
    (4, {1: 1}, {1: 0.25, 2: 0.0, 3: 0.0}),
    (0, {1: 3}, {1: 0.0, 2: 0.0, 3: 0.0}),
    (2, {3: 9}, {1: 0.0, 2: 0.0, 3: 1.0}),   # a stale index over-reporting is capped
])
def test_kv_overlap_scorer(num_blocks, overlap, expected):
    workers = [worker(1), worker(2), worker(3)]
    scorer = kv_overlap.KvOverlapScorer(kv_overlap.Params())
    got = scorer.score(request(num_blocks), snapshot(*workers, overlap=overlap), workers)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(("state", "cache_match", "recent", "cost"), [
    ({}, 0, 0, 0.0),
    ({"kv_blocks_used": 50}, 0, 0, 150.0),                 # 3.0 x 50%
    ({"active_requests": 4}, 0, 0, 4.0),                    # 1.0 x 4
    ({}, 7, 0, -70.0),                                      # -10 x 7 blocks
    ({"mem_bw_util": 0.2}, 0, 0, 10.0),                     # 0.5 x 20%
    ({}, 0, 3, -3.0),                                       # -1 x 3 blocks
    ({"kv_blocks_used": 50, "active_requests": 4, "mem_bw_util": 0.2}, 7, 3, 91.0),
])
def test_latency_cost_terms(state, cache_match, recent, cost):
    got = latency_cost.latency_cost(worker(1, **state), cache_match, recent,
                                    latency_cost.Params())
    assert got == pytest.approx(cost)


def test_latency_cost_coefficients_are_parameters():
    params = latency_cost.Params(occupancy_weight=1.0, cache_match_weight=2.0)
    got = latency_cost.latency_cost(worker(1, kv_blocks_used=30), 5, 0, params)
    assert got == pytest.approx(30.0 - 10.0)


# Each case: (a, b) worker states as (fields, cached blocks, recent blocks); `a` must win.
SEED_ORDERING = {
    "prefix cached and low load beats loaded": (
        ({"kv_blocks_used": 10, "active_requests": 1}, 8, 0),
        ({"kv_blocks_used": 70, "active_requests": 12}, 0, 0)),
    "more cached blocks at equal load": (({"kv_blocks_used": 40}, 6, 0),
                                         ({"kv_blocks_used": 40}, 2, 0)),
    "lower occupancy at equal cache": (({"kv_blocks_used": 20}, 0, 0),
                                       ({"kv_blocks_used": 21}, 0, 0)),
    "fewer active requests": (({"active_requests": 2}, 0, 0), ({"active_requests": 3}, 0, 0)),
    "less memory bandwidth in use": (({"mem_bw_util": 0.1}, 0, 0),
                                     ({"mem_bw_util": 0.5}, 0, 0)),
    "recent prefix breaks a tie": (({}, 0, 4), ({}, 0, 0)),
    "long cached prefix outweighs occupancy": (({"kv_blocks_used": 60}, 40, 0), ({}, 0, 0)),
    "short cached prefix does not": (({}, 0, 0), ({"kv_blocks_used": 60}, 2, 0)),
}


@pytest.mark.parametrize("case", SEED_ORDERING.values(), ids=SEED_ORDERING.keys())
def test_latency_cost_seed_ordering(case):
    (a_state, a_cached, a_recent), (b_state, b_cached, b_recent) = case
    workers = [worker(1, **a_state), worker(2, **b_state)]
    snap = snapshot(*workers, overlap={1: a_cached, 2: b_cached},
                    recent={1: a_recent, 2: b_recent})
    scores = latency_cost.LatencyCostScorer(latency_cost.Params()).score(
        request(64), snap, workers)
    assert scores == {1: 1.0, 2: 0.0}


def test_latency_cost_scores_all_equal_as_one():
    workers = [worker(1), worker(2)]
    scores = latency_cost.LatencyCostScorer(latency_cost.Params()).score(
        request(), snapshot(*workers), workers)
    assert scores == {1: 1.0, 2: 1.0}


def test_round_robin_scores_rotate():
    workers = [worker(3), worker(1), worker(2)]
    scorer = round_robin.RoundRobinScorer(round_robin.Params())
    firsts = [scorer.score(request(), snapshot(*workers), workers) for _ in range(4)]
    assert firsts[0] == pytest.approx({1: 1.0, 2: 2 / 3, 3: 1 / 3})
    assert firsts[1] == pytest.approx({2: 1.0, 3: 2 / 3, 1: 1 / 3})
    assert [max(s, key=s.get) for s in firsts] == [1, 2, 3, 1]


def test_round_robin_profile_visits_every_worker_in_turn():
    rr = router(config([{"name": "rr", "type": "round-robin"},
                        {"name": "pick", "type": "max-score"}],
                       [{"pluginRef": "rr"}, {"pluginRef": "pick"}]))
    snap = snapshot(worker(10), worker(20), worker(30))
    picks = [rr.route(request(), snap).worker_id for _ in range(6)]
    assert picks == [10, 20, 30, 10, 20, 30]
