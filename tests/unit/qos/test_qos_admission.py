"""Admission rules, Retry-After, and which classes may preempt queued prefill work."""

from __future__ import annotations

import pytest

from splitserve.components.router.qos import admit, may_preempt, retry_after_s

from .qos_factories import config, estimate, request

pytestmark = pytest.mark.unit

DEFAULT = config()
# low: ttft 5000 ms, slack 500 ms -> limit max(5000, unloaded) + 500.

RULES = {
    # name: (class, estimate or None, config, admit, reason, retry_after, limit)
    "high is always admitted": ("high", estimate(ttft=60_000), DEFAULT, True,
                                "always-admit", None, None),
    "default is always admitted": ("default", estimate(ttft=60_000), DEFAULT, True,
                                   "always-admit", None, None),
    "low within its target": ("low", estimate(ttft=3000), DEFAULT, True, "within-slo",
                              None, 5500.0),
    "low at the limit exactly": ("low", estimate(ttft=5500), DEFAULT, True, "within-slo",
                                 None, 5500.0),
    "low just over the limit": ("low", estimate(ttft=5501), DEFAULT, False, "ttft-slo-risk",
                                1, 5500.0),
    "low 12.3 s over": ("low", estimate(ttft=17_800), DEFAULT, False, "ttft-slo-risk", 13,
                        5500.0),
    "low far over: retry capped": ("low", estimate(ttft=500_000), DEFAULT, False,
                                   "ttft-slo-risk", 30, 5500.0),
    "slack 0 rejects over target": ("low", estimate(ttft=5001),
                                    config(low_priority_threshold_ms=0), False,
                                    "ttft-slo-risk", 1, 5000.0),
    "long prompt on idle system": ("low", estimate(ttft=8000, unloaded=8000), DEFAULT, True,
                                   "within-slo", None, 8500.0),
    "long prompt behind a backlog": ("low", estimate(ttft=8600, unloaded=8000), DEFAULT,
                                     False, "ttft-slo-risk", 1, 8500.0),
    "no estimate": ("low", None, DEFAULT, True, "no-estimate", None, None),
    "warm-up rates": ("low", estimate(ttft=60_000, source="warmup"), DEFAULT, True,
                      "no-estimate", None, None),
    "warm-up decode rate only": ("low", estimate(ttft=60_000, decode_source="warmup"),
                                 DEFAULT, True, "no-estimate", None, None),
    "stale estimate": ("low", estimate(ttft=60_000, stale=True), DEFAULT, True,
                       "stale-estimate", None, None),
    "early rejection off": ("low", estimate(ttft=60_000),
                            config(enable_early_rejection=False), True,
                            "early-rejection-disabled", None, None),
    "slo rejection off": ("low", estimate(ttft=60_000), config(reject_on_slo_violation=False),
                          True, "slo-rejection-disabled", None, None),
}


@pytest.mark.parametrize("case", RULES.values(), ids=RULES.keys())
def test_admission_rules(case):
    class_name, est, cfg, admitted, reason, retry, limit = case
    verdict = admit(request(class_name, max_tokens=100), est, cfg)
    assert (verdict.admit, verdict.reason, verdict.class_name) == (admitted, reason,
                                                                   class_name)
    assert verdict.retry_after_s == retry
    assert verdict.limit_ms == limit
    assert verdict.est_ttft_ms == (est.est_ttft_ms if est is not None else None)
    if admitted:
        assert verdict.max_tokens == 100
    else:
        assert verdict.degrade == () and verdict.max_tokens is None


def test_slack_applies_to_every_rejectable_class():
    cfg = config(classes=[
        {"name": "gold", "ttft_ms": 500, "tpot_ms": 50, "may_reject": False,
         "may_degrade": False},
        {"name": "silver", "ttft_ms": 1000, "tpot_ms": 100, "may_reject": True,
         "may_degrade": False},
        {"name": "bronze", "ttft_ms": 3000, "tpot_ms": 200, "may_reject": True,
         "may_degrade": True}], default_class="silver", low_priority_threshold_ms=200)
    assert admit(request("silver"), estimate(ttft=1200), cfg).admit
    rejected = admit(request("silver"), estimate(ttft=1201), cfg)
    assert (rejected.admit, rejected.limit_ms) == (False, 1200.0)
    assert admit(request("bronze"), estimate(ttft=3200), cfg).admit


def test_unknown_class_is_treated_as_default():
    verdict = admit(request("platinum"), estimate(ttft=60_000), DEFAULT)
    assert (verdict.admit, verdict.reason, verdict.class_name) == (True, "always-admit",
                                                                   "default")


RETRY = {
    # name: (est_ttft_ms, limit_ms, seconds)
    "barely over": (5500.1, 5500, 1),
    "one second over": (6500, 5500, 1),
    "just over one second": (6501, 5500, 2),
    "not over at all": (5000, 5500, 1),
    "far over": (40_000, 5500, 30),
}


@pytest.mark.parametrize("case", RETRY.values(), ids=RETRY.keys())
def test_retry_after(case):
    est_ttft, limit, seconds = case
    assert retry_after_s(est_ttft, limit) == seconds


PREEMPT = {
    # name: (queued class, incoming class, config, may preempt)
    "high over low": ("low", "high", DEFAULT, True),
    "default over low": ("low", "default", DEFAULT, True),
    "high over default (never rejected)": ("default", "high", DEFAULT, False),
    "low over high": ("high", "low", DEFAULT, False),
    "same class": ("low", "low", DEFAULT, False),
    "unknown queued counts as default": ("mystery", "high", DEFAULT, False),
    "unknown incoming counts as default": ("low", "mystery", DEFAULT, True),
    "rejectable default may be preempted": (
        "default", "high",
        config(classes=[{"name": "high", "ttft_ms": 1, "tpot_ms": 1, "may_reject": False,
                         "may_degrade": False},
                        {"name": "default", "ttft_ms": 2, "tpot_ms": 2, "may_reject": True,
                         "may_degrade": False}]), True),
}


@pytest.mark.parametrize("case", PREEMPT.values(), ids=PREEMPT.keys())
def test_may_preempt(case):
    queued, incoming, cfg, expected = case
    assert may_preempt(queued, incoming, cfg) is expected


AT_TARGETS = config(classes=[{"name": "default", "ttft_ms": 2000, "tpot_ms": 50,
                              "may_reject": True}], low_priority_threshold_ms=0)
SHADOW = AT_TARGETS.model_copy(update={"mode": "shadow"})

TPOT_RULES = {
    # name: (estimate, config, admit, reason, would_reject)
    "batch fits both targets": (estimate(ttft=500, tpot=45, batch=6), AT_TARGETS, True,
                                "within-slo", False),
    "batch misses TPOT": (estimate(ttft=500, tpot=51, batch=7), AT_TARGETS, False,
                          "tpot-slo-risk", False),
    "TTFT is judged first": (estimate(ttft=2001, tpot=80, batch=7), AT_TARGETS, False,
                             "ttft-slo-risk", False),
    "a decode average is not a batch prediction": (estimate(ttft=500, tpot=80), AT_TARGETS,
                                                   True, "within-slo", False),
    "slow alone: not refused for the worker's own speed": (
        estimate(ttft=500, tpot=70, batch=1, unloaded_tpot=70), AT_TARGETS, True,
        "within-slo", False),
    "slow alone and slower in the batch": (
        estimate(ttft=500, tpot=71, batch=2, unloaded_tpot=70), AT_TARGETS, False,
        "tpot-slo-risk", False),
    "TPOT still at warm-up: TTFT alone is judged": (
        estimate(ttft=500, tpot=80, batch=7, decode_source="warmup"), AT_TARGETS, True,
        "within-slo", False),
    "TPOT at warm-up and TTFT over": (
        estimate(ttft=2500, tpot=80, batch=7, decode_source="warmup"), AT_TARGETS, False,
        "ttft-slo-risk", False),
    "shadow: would refuse for TPOT": (estimate(ttft=500, tpot=51, batch=7), SHADOW, True,
                                      "tpot-slo-risk", True),
    "shadow: would refuse for TTFT": (estimate(ttft=9000, batch=1), SHADOW, True,
                                      "ttft-slo-risk", True),
    "shadow: within both": (estimate(ttft=500, tpot=20, batch=1), SHADOW, True,
                            "within-slo", False),
}


@pytest.mark.parametrize("case", TPOT_RULES.values(), ids=TPOT_RULES.keys())
def test_tpot_rule_and_shadow_mode(case):
    est, cfg, admitted, reason, would_reject = case
    verdict = admit(request("default", max_tokens=100), est, cfg)
    assert (verdict.admit, verdict.reason, verdict.would_reject) == (admitted, reason,
                                                                     would_reject)
    assert (verdict.retry_after_s is None) == admitted
    if est.tpot_batch and est.decode_source != "warmup":
        assert verdict.est_tpot_ms == est.est_tpot_ms
        assert verdict.tpot_limit_ms == max(50, est.unloaded_tpot_ms)


def test_shadow_mode_degrades_nothing():
    cfg = config(mode="shadow")
    verdict = admit(request("low", max_tokens=1000), estimate(ttft=5000, tpot=500), cfg)
    assert verdict.admit and verdict.degrade == () and verdict.max_tokens == 1000


def test_the_one_line_admission_form_validates_with_defaults():
    cfg = config(classes=[{"name": "default", "ttft_ms": 2000, "tpot_ms": 50,
                           "may_reject": True}], low_priority_threshold_ms=0)
    (cls,) = cfg.classes
    assert (cls.may_reject, cls.may_degrade) == (True, False)
    assert cfg.mode == "enforce" and cfg.queue.max_inflight_per_worker == 0


def test_the_tpot_margin_judges_the_spread_of_a_short_answer():
    """With ``estimator.tpot_margin_sd`` the TPOT rule judges the mean plus that many
    standard deviations of the stalls the request's own decode may meet."""
    est = estimate(ttft=500, tpot=40, batch=4).model_copy(update={"tpot_spread_ms": 8.0})
    assert admit(request("default", max_tokens=20), est, AT_TARGETS).admit  # mean: 40 < 50
    margin = AT_TARGETS.model_copy(update={"estimator": AT_TARGETS.estimator.model_copy(
        update={"tpot_margin_sd": 1.5})})
    refused = admit(request("default", max_tokens=20), est, margin)
    assert (refused.admit, refused.reason) == (False, "tpot-slo-risk")  # 40 + 12 > 50
    calm = est.model_copy(update={"tpot_spread_ms": 6.0})
    assert admit(request("default", max_tokens=20), calm, margin).admit  # 40 + 9 < 50
