"""Estimator EMAs (per worker and pool), fall-backs, staleness and the estimate formula."""

from __future__ import annotations

import pytest

from splitserve.components.router.qos import Backlog, EstimatorParams, LatencyEstimator

pytestmark = pytest.mark.unit


def estimator(smoothing: float = 0.5, max_age_s: float = 1.0) -> LatencyEstimator:
    """An estimator with warm-up rates 0.25 ms/prefill token, 30 ms/decode token."""
    return LatencyEstimator(EstimatorParams(smoothing=smoothing), max_age_s=max_age_s)


EMA = {
    # name: (smoothing, samples as (tokens, seconds), expected ms per token)
    "first sample taken as is": (0.5, [(100, 0.1)], 1.0),
    "two samples, alpha 0.5": (0.5, [(100, 0.1), (100, 0.3)], 2.0),
    "three samples, alpha 0.2": (0.2, [(100, 0.1), (100, 0.2), (100, 0.3)],
                                 0.2 * 3.0 + 0.8 * (0.2 * 2.0 + 0.8 * 1.0)),
    "alpha 1 keeps the newest": (1.0, [(10, 1.0), (10, 0.01)], 1.0),
    "normalised per token": (0.5, [(1000, 1.0), (10, 0.01)], 1.0),
}


@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("case", EMA.values(), ids=EMA.keys())
def test_ema_per_token(kind, case):
    smoothing, samples, expected = case
    est = estimator(smoothing)
    observe = est.observe_prefill if kind == "prefill" else est.observe_decode
    for t, (tokens, seconds) in enumerate(samples):
        observe("w1", "pool-a", tokens, seconds, now=float(t))
    for rate in (est.rate(kind, "pool-a", "w1"), est.rate(kind, "pool-a")):
        assert rate.value == pytest.approx(expected)
        assert rate.samples == len(samples)


def test_rate_falls_back_worker_then_pool_then_warmup():
    est = estimator()
    est.observe_prefill("w1", "prefill", 100, 0.1, now=0.0)   # 1 ms/token
    est.observe_prefill("w2", "prefill", 100, 0.3, now=0.0)   # 3 ms/token; pool -> 2
    assert est.rate("prefill", "prefill", "w1").source == "worker"
    assert est.rate("prefill", "prefill", "w1").value == pytest.approx(1.0)
    pool = est.rate("prefill", "prefill", "w9")
    assert (pool.source, pool.value) == ("pool", pytest.approx(2.0))
    cold = est.rate("prefill", "other-pool", "w9")
    assert (cold.source, cold.value, cold.samples) == ("warmup", 0.25, 0)
    assert est.rate("decode", "decode").source == "warmup"
    assert est.rate("decode", "decode").value == 30.0


def test_prefill_and_decode_series_are_separate():
    est = estimator()
    est.observe_decode("w1", "decode", 10, 0.5, now=0.0)
    assert est.rate("prefill", "decode", "w1").source == "warmup"
    assert est.rate("decode", "decode", "w1").value == pytest.approx(50.0)


@pytest.mark.parametrize("tokens, seconds", [(0, 1.0), (-1, 1.0), (10, -0.1),
                                             (10, float("nan")), (10, float("inf"))])
def test_bad_observations_are_refused(tokens, seconds):
    with pytest.raises(ValueError):
        estimator().observe_prefill("w1", "prefill", tokens, seconds, now=0.0)


def test_bad_kind_and_request_tokens_are_refused():
    with pytest.raises(ValueError):
        estimator().rate("encode", "prefill")
    with pytest.raises(ValueError):
        estimator().estimate(-1, Backlog(at=0.0), now=0.0)
    with pytest.raises(ValueError):
        LatencyEstimator(max_age_s=0)


def measured(max_age_s: float = 1.0) -> LatencyEstimator:
    """Prefill 0.5 ms/token (mean prompt 400 tokens), decode 20 ms/token."""
    est = estimator(max_age_s=max_age_s)
    est.observe_prefill("p1", "prefill", 400, 0.2, now=0.0)
    est.observe_decode("d1", "decode", 50, 1.0, now=0.0)
    return est


FORMULA = {
    # name: (request tokens, backlog fields, est_ttft, queue_wait, unloaded)
    "idle: own prefill + one step": (1000, {}, 520.0, 0.0, 520.0),
    "queued tokens, one worker": (1000, {"prefill_queued_tokens": 4000}, 2520.0, 2000.0, 520.0),
    "queued tokens, four workers": (1000, {"prefill_queued_tokens": 4000,
                                           "prefill_workers": 4}, 1020.0, 500.0, 520.0),
    "request count x mean prompt": (1000, {"prefill_queued_requests": 5}, 1520.0, 1000.0,
                                    520.0),
    "given tokens beat the count": (1000, {"prefill_queued_requests": 5,
                                           "prefill_queued_tokens": 0}, 520.0, 0.0, 520.0),
    "decode queue, one step each": (0, {"decode_queued_requests": 3}, 80.0, 60.0, 20.0),
    "everything": (200, {"prefill_queued_tokens": 1000, "prefill_workers": 2,
                         "decode_queued_requests": 2}, 250.0 + 40.0 + 100.0 + 20.0,
                   290.0, 120.0),
}


@pytest.mark.parametrize("case", FORMULA.values(), ids=FORMULA.keys())
def test_estimate_formula(case):
    tokens, fields, ttft, wait, unloaded = case
    e = measured().estimate(tokens, Backlog(at=0.0, **fields), now=0.0)
    assert e.est_ttft_ms == pytest.approx(ttft)
    assert e.queue_wait_ms == pytest.approx(wait)
    assert e.unloaded_ttft_ms == pytest.approx(unloaded)
    assert e.est_tpot_ms == pytest.approx(20.0)
    assert (e.prefill_per_token_ms, e.decode_per_token_ms) == (0.5, 20.0)
    assert e.observed and e.usable
    assert e.prefill_tokens_assumed == ("prefill_queued_tokens" not in fields)


def test_estimate_uses_the_named_workers():
    est = measured()
    est.observe_decode("d2", "decode", 10, 1.0, now=0.0)   # 100 ms/token on d2 only
    e = est.estimate(0, Backlog(at=0.0), now=0.0, decode_worker="d2")
    assert (e.decode_source, e.est_tpot_ms) == ("worker", 100.0)


def test_warmup_estimate_is_not_observed():
    e = estimator().estimate(400, Backlog(at=0.0, prefill_queued_requests=2), now=0.0)
    assert (e.prefill_source, e.decode_source) == ("warmup", "warmup")
    assert e.prefill_queued_tokens == 1024.0                  # 2 x warm-up mean of 512
    assert e.est_ttft_ms == pytest.approx(1024 * 0.25 + 400 * 0.25 + 30.0)
    assert not e.observed and not e.usable


STALENESS = {
    # name: (backlog at, now, max age, age, stale)
    "fresh": (10.0, 10.5, 1.0, 0.5, False),
    "exactly the limit is fresh": (10.0, 11.0, 1.0, 1.0, False),
    "older than the limit": (10.0, 11.5, 1.0, 1.5, True),
    "longer limit": (10.0, 11.5, 2.0, 1.5, False),
    "backlog stamped after now": (10.2, 10.0, 1.0, 0.0, False),
}


@pytest.mark.parametrize("case", STALENESS.values(), ids=STALENESS.keys())
def test_staleness(case):
    at, now, max_age, age, stale = case
    e = measured(max_age).estimate(10, Backlog(at=at), now=now)
    assert e.age_s == pytest.approx(age) and e.stale is stale and e.computed_at == now
    assert e.usable is (not stale)


FIT = {
    # name: (samples as (tokens, seconds), expected fixed ms, expected ms per token)
    "fixed floor and per-token slope": ([(4, 0.041), (1000, 0.140), (4000, 0.440),
                                         (8000, 0.840)], 40.6, 0.1),
    "equal sizes: the ratio through the origin": ([(400, 0.2), (400, 0.4)], 0.0,
                                                  (0.5 * 0.4 + 0.5 * 0.2) * 1000 / 400),
    "spread under 10% of the mean: the ratio": ([(1000, 0.2), (1050, 0.1)], 0.0,
                                                0.5 * (200 + 100) / (0.5 * (1000 + 1050))),
    "slope not positive: the ratio": ([(100, 0.3), (1000, 0.2)], 0.0,
                                      0.5 * (300 + 200) / (0.5 * (100 + 1000))),
    "intercept negative: the line through the origin": (
        [(100, 0.01), (1000, 0.5)], 0.0, (100 * 10 + 1000 * 500) / (100 ** 2 + 1000 ** 2)),
}


@pytest.mark.parametrize("case", FIT.values(), ids=FIT.keys())
def test_prefill_time_is_fitted_as_fixed_plus_per_token(case):
    samples, fixed, per_token = case
    est = estimator(smoothing=0.5)
    for t, (tokens, seconds) in enumerate(samples):
        est.observe_prefill("w1", "pool-a", tokens, seconds, now=float(t))
    for rate in (est.rate("prefill", "pool-a", "w1"), est.rate("prefill", "pool-a")):
        assert rate.fixed_ms == pytest.approx(fixed, abs=0.5)
        assert rate.value == pytest.approx(per_token, rel=0.02)
        assert rate.samples == len(samples)


def test_short_warmup_prompts_do_not_make_long_prompts_look_slow():
    """Four-token prompts at 40 ms each, then a few real prompts: per token the warm-up
    alone says 10 ms/token, i.e. 20 s for 2,000 tokens; the fit keeps the 40 ms floor."""
    est = estimator(smoothing=0.2)
    for t in range(8):
        est.observe_prefill("w1", "pool", 4, 0.040, now=float(t))
    for t, (tokens, seconds) in enumerate([(1700, 0.11), (300, 0.05), (6000, 0.28)]):
        est.observe_prefill("w1", "pool", tokens, seconds, now=10.0 + t)
    e = est.estimate(2000, Backlog(at=20.0), now=20.0, prefill_pool="pool",
                     decode_pool="pool", first_step=False)
    assert 50.0 < e.unloaded_ttft_ms < 200.0
    assert e.prefill_fixed_ms > 20.0


def test_first_step_is_left_out_when_the_fit_holds_it():
    est = measured()
    with_step = est.estimate(100, Backlog(at=0.0), now=0.0)
    without = est.estimate(100, Backlog(at=0.0), now=0.0, first_step=False)
    assert with_step.unloaded_ttft_ms - without.unloaded_ttft_ms == pytest.approx(20.0)
    assert without.unloaded_ttft_ms == pytest.approx(100 * 0.5)
