"""The score-based offload policy: the seed's example, every metric, weights, minimum."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitserve.components.disagg import build_decider, load_disaggregated_router_file

from .disagg_factories import offload_request, offload_snapshot, rule

pytestmark = pytest.mark.unit

SEED_FILE = Path(__file__).resolve().parents[3] / "configs" / "policies" / "score_offload.yaml"


def score_decider(rules: list[dict], min_score: float):
    """An enabled score decider with these rules."""
    return build_decider({"enable": True, "policies": rules,
                          "remote_prefill_min_score": min_score})


# (prompt, cached, queue) -> (remote, score, reason)
SEED_CASES = {
    "long prompt, short queue": ((1000, 0, 2), (True, 0.7, "min-score-met")),
    "long prompt, queue at 10": ((1000, 0, 10), (False, 0.4, "below-min-score")),
    "short prompt, short queue": ((100, 0, 0), (False, 0.0, "below-min-score")),
    "short prompt, long queue": ((100, 0, 30), (False, -0.3, "below-min-score")),
    "long prompt mostly cached": ((1000, 900, 0), (False, 0.0, "below-min-score")),
    "exactly 256 after the hit": ((300, 44, 9), (True, 0.7, "min-score-met")),
}


@pytest.mark.parametrize("case", SEED_CASES.values(), ids=SEED_CASES.keys())
def test_seed_example(case):
    (prompt, cached, queue), (remote, score, reason) = case
    decider = build_decider(load_disaggregated_router_file(SEED_FILE))
    decision = decider.decide(offload_request(prompt, cached), offload_snapshot(queue))
    assert (decision.remote, decision.reason) == (remote, reason)
    assert decision.score == pytest.approx(score)
    assert set(decision.contributions) == {"prefill_length", "prefill_queue_depth"}
    assert sum(decision.contributions.values()) == pytest.approx(score)


# Each rule fires (or not) on its own; weight 1, min score 1.
METRIC_CASES = {
    "prefill_length fires": (rule("prefill_length", threshold=100), (150, 50), {}, True),
    "prefill_length below": (rule("prefill_length", threshold=100), (150, 51), {}, False),
    "prompt_length ignores cache": (rule("prompt_length", threshold=100), (150, 150), {}, True),
    "queue depth": (rule("prefill_queue_depth", threshold=4), (10, 0), {"queue": 4}, True),
    "queue depth below": (rule("prefill_queue_depth", threshold=4), (10, 0), {"queue": 3}, False),
    "decode active": (rule("decode_active_requests", threshold=8), (10, 0), {"active": 8}, True),
    "decode kv usage": (rule("decode_kv_usage", threshold=0.8), (10, 0), {"kv": 0.85}, True),
    "decode kv usage below": (rule("decode_kv_usage", threshold=0.8), (10, 0), {"kv": 0.5}, False),
}


@pytest.mark.parametrize("case", METRIC_CASES.values(), ids=METRIC_CASES.keys())
def test_each_metric(case):
    policy, (prompt, cached), load, remote = case
    decision = score_decider([policy], 1.0).decide(offload_request(prompt, cached),
                                                  offload_snapshot(**load))
    assert decision.remote is remote
    assert decision.contributions == {policy["metric"]: 1.0 if remote else 0.0}


@pytest.mark.parametrize(("priority", "remote"), [("batch", True), ("low", True),
                                                 ("interactive", False), ("default", False)])
def test_priority_classes(priority, remote):
    decider = score_decider([rule("priority", classes=["batch", "low"], weight=0.5)], 0.5)
    got = decider.decide(offload_request(10, priority=priority), offload_snapshot())
    assert got.remote is remote


def test_prefer_local_priority_vetoes():
    decider = score_decider([rule("prefill_length", threshold=256, weight=0.7),
                             rule("priority", "prefer_local", 0.5, classes=["interactive"])], 0.5)
    assert decider.decide(offload_request(1000, priority="batch"), offload_snapshot()).remote
    assert not decider.decide(offload_request(1000, priority="interactive"),
                              offload_snapshot()).remote


@pytest.mark.parametrize(("local_weight", "min_score", "remote"), [
    (0.2, 0.5, True),     # 0.7 - 0.2 is exactly 0.5 once rounded
    (0.21, 0.5, False),
    (0.0, 0.7, True),
    (0.0, 0.70001, None),  # unreachable: rejected by validation (see config tests)
])
def test_min_score_boundary(local_weight, min_score, remote):
    rules = [rule("prefill_length", threshold=256, weight=0.7),
             rule("prefill_queue_depth", "prefer_local", local_weight, threshold=1)]
    if remote is None:
        with pytest.raises(ValueError):
            score_decider(rules, min_score)
        return
    decision = score_decider(rules, min_score).decide(offload_request(1000),
                                                      offload_snapshot(queue=5))
    assert decision.remote is remote


def test_rules_on_one_metric_add_up():
    decider = score_decider([rule("prefill_length", threshold=256, weight=0.4),
                             rule("prefill_length", threshold=1024, weight=0.4)], 0.8)
    medium = decider.decide(offload_request(500), offload_snapshot())
    long = decider.decide(offload_request(2000), offload_snapshot())
    assert (medium.remote, medium.contributions) == (False, {"prefill_length": 0.4})
    assert (long.remote, long.contributions) == (True, {"prefill_length": 0.8})
