"""Graceful-degradation steps: triggers, switches, floors, order, and who they apply to."""

from __future__ import annotations

import pytest

from splitserve.components.router.qos import LoadSignals, admit

from .qos_factories import config, estimate, request

pytestmark = pytest.mark.unit

CALM = estimate(ttft=100, tpot=20)
OFF = {"enable": False}

STEPS = {
    # name: (max_tokens, estimate, load fields, config fields,
    #        expected [(kind, detail, value)], effective max_tokens)
    "calm: nothing": (1000, CALM, {}, {}, [], 1000),
    "cap: est ttft >= 0.8 x target": (
        1000, estimate(ttft=4000), {}, {},
        [("cap-max-tokens", "est-ttft>=0.8x5000ms", 256)], 256),
    "cap: est ttft below the ratio": (1000, estimate(ttft=3999), {}, {}, [], 1000),
    "cap: kv usage": (1000, CALM, {"decode_kv_usage": 0.85}, {},
                      [("cap-max-tokens", "kv-usage>=0.85", 256)], 256),
    "cap: stale estimate does not trigger": (1000, estimate(ttft=5000, stale=True), {}, {},
                                             [], 1000),
    "cap: warm-up estimate does not trigger": (1000, estimate(ttft=5000, source="warmup"),
                                               {}, {}, [], 1000),
    "cap: kv still triggers without an estimate": (
        1000, None, {"decode_kv_usage": 0.9}, {},
        [("cap-max-tokens", "kv-usage>=0.85", 256)], 256),
    "cap: request already below the cap": (200, estimate(ttft=4000), {}, {}, [], 200),
    "cap: switched off": (1000, estimate(ttft=4000), {"decode_kv_usage": 1.0},
                          {"cap_max_tokens": OFF}, [], 1000),
    "cap: custom cap": (1000, CALM, {"decode_kv_usage": 0.9},
                        {"cap_max_tokens": {"max_tokens": 100}},
                        [("cap-max-tokens", "kv-usage>=0.85", 100)], 100),
    "local prefill: queue at threshold": (
        1000, CALM, {"prefill_queue_depth": 8}, {},
        [("local-prefill", "prefill-queue-depth>=8", 8)], 1000),
    "local prefill: queue below threshold": (1000, CALM, {"prefill_queue_depth": 7}, {}, [],
                                             1000),
    "local prefill: switched off": (1000, CALM, {"prefill_queue_depth": 50},
                                    {"disable_remote_prefill_for_low_priority": OFF}, [], 1000),
    "adaptive: twice the target tpot halves": (
        1000, estimate(tpot=500), {}, {},
        [("adaptive-generation-limit", "est-tpot>250ms", 500)], 500),
    "adaptive: rounds down": (1000, estimate(tpot=300), {}, {},
                              [("adaptive-generation-limit", "est-tpot>250ms", 833)], 833),
    "adaptive: floor": (1000, estimate(tpot=10_000), {}, {},
                        [("adaptive-generation-limit", "est-tpot>250ms", 64)], 64),
    "adaptive: at target": (1000, estimate(tpot=250), {}, {}, [], 1000),
    "adaptive: already under the floor": (50, estimate(tpot=500), {}, {}, [], 50),
    "adaptive: stale backlog is fine": (
        1000, estimate(tpot=500, stale=True), {}, {},
        [("adaptive-generation-limit", "est-tpot>250ms", 500)], 500),
    "adaptive: warm-up decode rate": (1000, estimate(tpot=500, decode_source="warmup"), {},
                                      {}, [], 1000),
    "adaptive: switched off": (1000, estimate(tpot=500), {},
                               {"adaptive_generation_limit": OFF}, [], 1000),
    "all three, in order, compounding": (
        1000, estimate(ttft=4500, tpot=500), {"prefill_queue_depth": 9}, {},
        [("cap-max-tokens", "est-ttft>=0.8x5000ms", 256),
         ("local-prefill", "prefill-queue-depth>=8", 9),
         ("adaptive-generation-limit", "est-tpot>250ms", 128)], 128),
}


@pytest.mark.parametrize("case", STEPS.values(), ids=STEPS.keys())
def test_degradation_steps(case):
    max_tokens, est, load, degradation, expected, effective = case
    cfg = config(degradation=degradation)
    verdict = admit(request("low", max_tokens), est, cfg, LoadSignals(**load))
    assert verdict.admit
    assert [(d.kind, d.detail, d.value) for d in verdict.degrade] == expected
    assert verdict.max_tokens == effective
    assert verdict.prefill_locally is any(kind == "local-prefill" for kind, _, _ in expected)


@pytest.mark.parametrize("class_name", ["high", "default"])
def test_non_degradable_classes_are_untouched(class_name):
    verdict = admit(request(class_name, 1000), estimate(ttft=60_000, tpot=1000), config(),
                    LoadSignals(prefill_queue_depth=100, decode_kv_usage=1.0))
    assert verdict.admit and verdict.degrade == () and verdict.max_tokens == 1000


def test_degradable_class_that_is_never_rejected_is_degraded():
    cfg = config(classes=[{"name": "default", "ttft_ms": 2000, "tpot_ms": 150,
                           "may_reject": False, "may_degrade": True}])
    verdict = admit(request("default", 1000), None, cfg, LoadSignals(decode_kv_usage=0.9))
    assert verdict.reason == "always-admit"
    assert [d.kind for d in verdict.degrade] == ["cap-max-tokens"]


def test_rejected_requests_get_no_steps():
    verdict = admit(request("low", 1000), estimate(ttft=60_000, tpot=1000), config(),
                    LoadSignals(prefill_queue_depth=100, decode_kv_usage=1.0))
    assert not verdict.admit and verdict.degrade == ()
