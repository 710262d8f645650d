"""Per-worker prediction: TTFT from the prompt tokens ahead on the worker drained at the
learned rate, TPOT from the KV the batch it joins holds, and the calibration of each."""

from __future__ import annotations

import pytest

from splitserve.components.router.qos.predictor import MIN_SAMPLES, LatencyPredictor

pytestmark = pytest.mark.unit

# Every sample on one line: TTFT = 50 ms + 0.1 ms per token (ahead + own).
TTFT_LINE = [(100, 0.060), (1000, 0.150), (2000, 0.250)]


def teach(p: LatencyPredictor, worker: str = "9", t: float = 0.0, *,
          ttft: list[tuple[int, float]] = TTFT_LINE, tpot_ms: float = 20.0,
          batch: int = 1, output: int = 11) -> float:
    """Run requests alone (``batch`` at once) on ``worker`` with the given timings, each
    released ``duration`` after its placement, 10 s apart; returns the clock after."""
    for own, ttft_s in ttft * 2:
        duration = ttft_s + (output - 1) * tpot_ms / 1000.0
        rids = [f"t{t}-{i}" for i in range(batch)]
        for rid in rids:
            p.place(rid, worker, p.predict(worker, own, t), t, class_name="default")
        for rid in rids:
            p.finish(rid, t + duration, ok=True, ttft_s=ttft_s, duration_s=duration,
                     output_tokens=output)
        t += 10.0
    return t


def test_before_enough_samples_the_prediction_is_a_warm_up_guess():
    p = LatencyPredictor()
    est = p.predict("a", 400, 0.0)
    assert (est.prefill_source, est.decode_source) == ("warmup", "warmup")
    assert not est.observed
    assert est.est_ttft_ms == pytest.approx(400 * 0.25)
    assert est.tpot_batch == 1


def test_ttft_line_is_learned_and_used_by_other_workers_through_the_pool():
    p = LatencyPredictor()
    t = teach(p)
    fixed, per_token, source = p.ttft_line("a", t)
    assert (fixed, per_token, source) == (pytest.approx(50.0), pytest.approx(0.1), "pool")
    assert p.ttft_line("9", t)[2] == "worker"


@pytest.mark.parametrize(("placed", "released", "own", "ahead", "ttft"), [
    # (uncached tokens placed on the worker before, how many of them released, own,
    #  tokens ahead, est TTFT ms)
    ([], 0, 500, 0, 50 + 50),
    ([1000, 1000], 0, 500, 2000, 50 + 250),
    ([1000, 1000], 1, 500, 1000, 50 + 150),
    ([1000, 1000], 2, 500, 0, 50 + 50),
    ([4000] * 10, 0, 100, 40_000, 50 + 4010),
], ids=["idle", "two-ahead", "one-released", "all-released", "deep-queue"])
def test_ttft_prediction_from_the_queue_ahead(placed, released, own, ahead, ttft):
    p = LatencyPredictor()
    t = teach(p)
    for i, n in enumerate(placed):
        p.place(f"q{i}", "a", p.predict("a", n, t), t, class_name="default")
    for i in range(released):
        p.finish(f"q{i}", t + 1.0, ok=False, ttft_s=None, duration_s=None, output_tokens=0)
    est = p.predict("a", own, t + 1.0)
    assert est.prefill_queued_tokens == pytest.approx(ahead)
    assert est.est_ttft_ms == pytest.approx(ttft)
    assert est.unloaded_ttft_ms == pytest.approx(50 + own * 0.1)
    assert p.predict("b", own, t + 1.0).est_ttft_ms == pytest.approx(50 + own * 0.1)


def test_tpot_prediction_from_the_kv_the_batch_it_joins_holds():
    p = LatencyPredictor()
    one = [(100, 0.060)]  # 100-token prompts
    t = teach(p, ttft=one, tpot_ms=20.0, batch=1)
    t = teach(p, ttft=one, t=t, tpot_ms=30.0, batch=3)
    # 20 ms with 100 tokens of context, 30 ms with 300: 15 ms + 5 ms per 100 tokens.
    for i in range(4):
        p.place(f"r{i}", "a", p.predict("a", 100, t), t, class_name="default")
    est = p.predict("a", 100, t)
    assert est.tpot_batch == 5
    assert est.est_tpot_ms == pytest.approx(15 + 5 * 5, rel=0.05)
    assert est.unloaded_tpot_ms == pytest.approx(20, rel=0.05)
    # The same number of requests with ten times the context: the step reads their KV,
    # not their count (a line on the count would say 40 ms here too).
    for i in range(4):
        p.place(f"long{i}", "b", p.predict("b", 100, t, context_tokens=1000), t,
                class_name="default")
    est = p.predict("b", 100, t)
    assert est.tpot_batch == 5
    assert est.est_tpot_ms == pytest.approx(15 + 5 * 41, rel=0.05)
    # Cached prompt tokens are prefilled by no one but held all the same.
    assert p.predict("b", 100, t, context_tokens=1100).est_tpot_ms == \
        pytest.approx(15 + 5 * 51, rel=0.05)


def test_tpot_without_evidence_of_growth_is_flat():
    p = LatencyPredictor()
    t = teach(p, tpot_ms=20.0, batch=1)
    for i in range(30):
        p.place(f"r{i}", "a", p.predict("a", 100, t), t, class_name="default")
    assert p.predict("a", 100, t).est_tpot_ms == pytest.approx(20.0)


def test_finish_measures_ttft_from_the_placement_and_tpot_from_the_decode():
    p = LatencyPredictor()
    est = p.predict("a", 100, 100.0)
    p.place("r", "a", est, 100.0, class_name="gold", would_reject=True)
    # The frontend streamed from 100.5 (the route reply's trip and the admission queue
    # are not in its numbers): first token 0.2 s later, done at 102.0.
    cal = p.finish("r", 102.0, ok=True, ttft_s=0.2, duration_s=1.5, output_tokens=11)
    assert cal is not None
    assert cal.measured_ttft_ms == pytest.approx(700.0)
    assert cal.measured_tpot_ms == pytest.approx(130.0)
    assert (cal.class_name, cal.worker, cal.would_reject) == ("gold", "a", True)
    assert cal.predicted_ttft_ms == est.est_ttft_ms
    assert p.workers["a"].running == 0


@pytest.mark.parametrize(("ok", "ttft_s"), [(False, 0.1), (True, None)],
                         ids=["failed", "no-first-token"])
def test_unfinished_requests_teach_nothing(ok, ttft_s):
    p = LatencyPredictor()
    p.place("r", "a", p.predict("a", 100, 0.0), 0.0, class_name="default")
    assert p.finish("r", 1.0, ok=ok, ttft_s=ttft_s, duration_s=1.0, output_tokens=5) is None
    assert p.workers["a"].running == 0 and p.pool.ttft is None


def test_unknown_release_is_ignored_and_lost_releases_expire():
    p = LatencyPredictor()
    assert p.finish("nope", 1.0, ok=True, ttft_s=0.1, duration_s=1.0, output_tokens=5) is None
    p.place("old", "a", p.predict("a", 100, 0.0), 0.0, class_name="default")
    p.place("new", "a", p.predict("a", 100, 500.0), 500.0, class_name="default")
    p.expire(700.0, ttl_s=600.0)
    assert list(p.tickets) == ["new"] and p.workers["a"].running == 1


def test_a_series_is_trusted_after_min_samples():
    p = LatencyPredictor()
    for i in range(MIN_SAMPLES):
        assert p.predict("a", 100, i * 10.0).prefill_source == "warmup"
        p.place(f"r{i}", "a", p.predict("a", 100, i * 10.0), i * 10.0, class_name="default")
        p.finish(f"r{i}", i * 10.0 + 1, ok=True, ttft_s=0.1, duration_s=1.0, output_tokens=5)
    assert p.predict("a", 100, 100.0).observed


def test_a_wait_in_an_admission_queue_adds_to_the_ttft():
    p = LatencyPredictor()
    t = teach(p)
    est = p.predict("a", 500, t, held_ms=700.0)
    assert est.queue_wait_ms == pytest.approx(700.0)
    assert est.est_ttft_ms == pytest.approx(50 + 500 * 0.1 + 700)
    assert p.service_ms is not None and p.service_ms > 0


def test_a_restore_from_a_lower_kv_tier_adds_its_measured_time_and_teaches_nothing():
    p = LatencyPredictor()
    t = teach(p)
    plain, restoring = (p.predict("a", 500, t, restore_ms=ms) for ms in (0.0, 40.0))
    assert (restoring.restore_ms, plain.restore_ms) == (40.0, 0.0)
    for field in ("unloaded_ttft_ms", "est_ttft_ms"):  # its own time, not the queue's
        assert getattr(restoring, field) - getattr(plain, field) == pytest.approx(40.0)
    # Its TTFT, restore included, lands on the line: the line is taught without it.
    for i, own in enumerate((100, 1000, 2000) * 4):
        rid = f"r{i}"
        p.place(rid, "a", p.predict("a", own, t, restore_ms=40.0), t, class_name="default")
        p.first_token(rid, t + (50 + own * 0.1 + 40) / 1000.0)
        p.finish(rid, t + 1.0, ok=True, ttft_s=0.1, duration_s=0.9, output_tokens=11)
        t += 10.0
    fixed, per_token, _ = p.ttft_line("a", t)
    assert (fixed, per_token) == (pytest.approx(50.0, abs=0.5), pytest.approx(0.1, abs=1e-3))


def test_a_reported_first_token_leaves_the_work_ahead_and_teaches_at_once():
    p = LatencyPredictor()
    t = teach(p)
    samples = p.pool.ttft.samples
    p.place("r", "a", p.predict("a", 1000, t), t, class_name="default")
    assert p.predict("a", 500, t).prefill_queued_tokens == 1000
    p.first_token("r", t + 0.15)
    assert p.predict("a", 500, t + 0.15).prefill_queued_tokens == 0
    assert p.pool.ttft.samples == samples + 1
    p.first_token("r", t + 0.2)  # reported twice: counted once
    cal = p.finish("r", t + 1.0, ok=True, ttft_s=0.1, duration_s=0.9, output_tokens=11)
    assert cal is not None and cal.measured_ttft_ms == pytest.approx(150.0)
    assert p.pool.ttft.samples == samples + 1  # not learned again at the release
    assert p.workers["a"].pending_tokens == 0 and p.workers["a"].inflight_tokens == 0


def test_decode_progress_teaches_tpot_before_the_answer_ends():
    p = LatencyPredictor()
    for i in range(3):  # three requests at once on one worker, still streaming
        p.place(f"r{i}", "a", p.predict("a", 100, 0.0), 0.0, class_name="default")
    for i in range(3):
        p.first_token(f"r{i}", 0.1)
    for i in range(3):
        p.decode_progress(f"r{i}", 16, 0.1 + 15 * 0.030)  # 30 ms per token in a batch of 3
        p.decode_progress(f"r{i}", 16, 9.0)  # once per request
    assert p.predict("a", 100, 1.0).decode_source != "warmup"
    assert p.tpot_line("a", 1.0)[:2] == (pytest.approx(30.0), 0.0)  # one bin: flat
    samples = p.pool.tpot.samples
    cal = p.finish("r0", 10.0, ok=True, ttft_s=0.1, duration_s=9.9, output_tokens=300)
    assert cal is not None and cal.measured_tpot_ms == pytest.approx(9.8 * 1000 / 299)
    assert p.pool.tpot.samples == samples  # taught once, mid-stream


def test_a_worker_busy_with_prompts_predicts_and_teaches_stalled_decodes():
    """A worker with prompt work ahead most of the time decodes 1 / (1 - busy) slower:
    the fit keeps the stall-free step, the prediction divides by the recent busy share."""
    p = LatencyPredictor()
    t = 0.0
    for i in range(4):  # stall-free teaching: 20 ms per token, nothing ahead
        p.place(f"q{i}", "a", p.predict("a", 100, t), t, class_name="default")
        p.first_token(f"q{i}", t + 0.05)
        p.decode_progress(f"q{i}", 16, t + 0.05 + 15 * 0.020)
        p.finish(f"q{i}", t + 1.0, ok=True, ttft_s=0.05, duration_s=1.0, output_tokens=40)
        t += 10.0
    calm = p.predict("a", 100, t)
    assert calm.est_tpot_ms == pytest.approx(20.0, rel=0.05)
    # Then prompts keep arriving: one always ahead for 6 s (busy -> ~0.95, capped 0.9).
    p.place("r", "a", p.predict("a", 100, t), t, class_name="default")
    p.first_token("r", t + 0.05)
    for k in range(60):
        p.place(f"p{k}", "a", p.predict("a", 4000, t + 0.1 * k), t + 0.1 * k,
                class_name="default")
        p.first_token(f"p{k}", t + 0.1 * k + 0.1)
        p.place(f"p{k}b", "a", p.predict("a", 4000, t + 0.1 * k + 0.1), t + 0.1 * k + 0.1,
                class_name="default")
        p.finish(f"p{k}", t + 0.1 * k + 0.1, ok=False, ttft_s=None, duration_s=None,
                 output_tokens=0)
    now = t + 6.0
    busy = p.workers["a"].busy
    assert busy > 0.9
    est = p.predict("a", 100, now)
    assert est.est_tpot_ms == pytest.approx(calm.est_tpot_ms / (1 - 0.9), rel=0.2)
    # "r" decoded at 200 ms per token through those stalls: the fit learns ~20 ms.
    samples = p.pool.tpot.samples
    p.decode_progress("r", 16, t + 0.05 + 15 * 0.200)
    assert p.pool.tpot.samples == samples + 1
    assert p.tpot_line("a", now)[0] == pytest.approx(20.0, rel=0.6)


def test_a_short_answer_on_a_busy_worker_has_the_widest_tpot_spread():
    """Prompts reach a busy worker as random events of the typical prefill time ``P`` at
    rate busy / P; over a decode of k - 1 steps the TPOT's standard deviation is
    sqrt(busy x TPOT x P / (k - 1)): largest for short answers, 0 on an idle worker."""
    p = LatencyPredictor()
    t = teach(p, "a")
    idle = p.predict("a", 100, t, output_tokens=20)
    assert idle.tpot_spread_ms == 0.0
    p.first_token("x", t)  # first tokens are reported (busy is measured)
    for k in range(20):  # a 2,000-token prompt always ahead for 2 s
        now = t + 0.1 * k
        p.place(f"p{k}", "a", p.predict("a", 2000, now), now, class_name="default")
        p.first_token(f"p{k}", now + 0.1)
    now = t + 2.0
    w = p.workers["a"]
    # the typical prefill: an EMA of the placed prompts' predicted prefill times (the
    # taught ones of 100-2,000 tokens, then these at 0.1 ms per token)
    assert w.busy > 0.9 and 10 < w.stall_ms < 2000 * 0.1
    short, long_ = (p.predict("a", 100, now, output_tokens=n) for n in (5, 401))
    busy = min(0.9, w.busy)
    assert short.tpot_spread_ms == pytest.approx(
        (busy * short.est_tpot_ms * w.stall_ms / 4) ** 0.5)
    # the long answer outlasts the burst: judged partly at the long-run share (lower),
    # so its spread is below a tenth of the short one's, by the same formula
    assert long_.est_tpot_ms < short.est_tpot_ms
    share = 1 - short.est_tpot_ms * (1 - busy) / long_.est_tpot_ms
    assert 0 < share < busy
    assert long_.tpot_spread_ms == pytest.approx(
        (share * long_.est_tpot_ms * w.stall_ms / 400) ** 0.5)
    assert long_.tpot_spread_ms < short.tpot_spread_ms / 10
    assert p.predict("a", 100, now, output_tokens=1).tpot_spread_ms == 0.0


def test_without_first_token_reports_busy_is_not_used():
    """A router process learns of a first token only at the release: prompts look ahead
    all the time there, so the busy share would always read 1 and is not used."""
    p = LatencyPredictor()
    t = teach(p)
    for k in range(50):
        p.place(f"p{k}", "a", p.predict("a", 4000, t + 0.1 * k), t + 0.1 * k,
                class_name="default")
    assert p.workers["a"].busy > 0.5
    est = p.predict("a", 100, t + 5.0)
    base, slope, _ = p.tpot_line("a", t + 5.0)
    assert est.est_tpot_ms == pytest.approx(base + slope * est.tpot_batch)


def test_a_prompt_far_longer_than_any_taught_is_a_guess_not_a_refusal():
    p = LatencyPredictor()
    # Only short requests so far (a fleet's warm-up): 20 ms each, whatever the length.
    teach(p, ttft=[(20, 0.020), (30, 0.020), (40, 0.020)])
    longest = p.pool.ttft.x_max
    assert longest == 40
    assert p.predict("9", 80, 100.0).prefill_source != "warmup"  # within 2x of it
    est = p.predict("9", 8000, 100.0)
    assert est.prefill_source == "warmup"  # the line through 40 tokens says little of 8000
    # Once long prompts were served, the same prediction is trusted again, and the work
    # ahead of a request is never limited so (a burst is judged as it builds up).
    t = teach(p, t=200.0, ttft=[(8000, 0.45), (6000, 0.35)])
    assert p.predict("9", 8000, t).prefill_source != "warmup"
    p.place("a", "9", p.predict("9", 8000, t), t, class_name="default")
    p.place("b", "9", p.predict("9", 8000, t), t, class_name="default")
    queued = p.predict("9", 8000, t)
    assert queued.prefill_source != "warmup" and queued.prefill_queued_tokens == 16000


def test_requests_later_than_predicted_scale_the_prediction_before_they_answer():
    """The fits say the queue drains fast, but the worker's oldest waiting request is
    already far later than predicted: new predictions on that worker carry its lateness
    (the fits could not learn it: nothing answered), others' do not; once it answers,
    the lag is gone."""
    from splitserve.components.router.qos.predictor import LAG_SLACK_MS

    p = LatencyPredictor()
    t = teach(p)
    p.first_tokens_reported = True  # first tokens are reported in process
    placed = [p.predict("a", 1000, t) for _ in range(4)]
    for i, est in enumerate(placed):
        p.place(f"q{i}", "a", est, t, class_name="default")
    fresh = p.predict("a", 500, t, class_name="default")
    assert fresh.ttft_lag == 1.0
    later = t + 10.0  # q0 was predicted 150 ms and has waited 10 s
    est = p.predict("a", 500, later, class_name="default")
    lag = 10_000.0 / (placed[0].est_ttft_ms + LAG_SLACK_MS)
    assert est.ttft_lag == pytest.approx(lag)
    assert est.est_ttft_ms == pytest.approx(fresh.est_ttft_ms * lag)
    assert est.unloaded_ttft_ms == pytest.approx(fresh.unloaded_ttft_ms)  # not the limit
    assert p.predict("b", 500, later, class_name="default").ttft_lag == 1.0
    assert p.predict("a", 500, later, class_name="batch").ttft_lag == 1.0  # other class
    p.first_token("q0", later)
    assert p.predict("a", 500, later, class_name="default").ttft_lag == pytest.approx(
        10_000.0 / (placed[1].est_ttft_ms + LAG_SLACK_MS))
    for i in range(1, 4):
        p.first_token(f"q{i}", later)
    assert p.predict("a", 500, later, class_name="default").ttft_lag == 1.0


def test_lateness_is_not_read_without_first_token_reports():
    """Behind a Router process a request waits until its release: its age is not a
    first token's lateness."""
    p = LatencyPredictor()
    t = teach(p)
    p.place("q", "a", p.predict("a", 1000, t), t, class_name="default")
    assert p.predict("a", 500, t + 30.0).ttft_lag == 1.0


def test_a_request_placed_again_before_its_release_moves_its_load():
    """A request migrated to another worker is placed again under the same id, and the
    release of its first placement may come after that: the first worker's queue and
    batch must not keep it forever."""
    p = LatencyPredictor()
    p.place("m", "a", p.predict("a", 800, 0.0), 0.0, class_name="default")
    p.place("m", "b", p.predict("b", 800, 1.0), 1.0, class_name="default")
    a, b = p.workers["a"], p.workers["b"]
    assert (a.running, a.kv, a.pending_tokens, len(a.waiting)) == (0, 0.0, 0.0, 0)
    assert (b.running, b.pending_tokens) == (1, 800.0)
    assert p.predict("a", 100, 1.0).prefill_queued_tokens == 0
    p.finish("m", 2.0, ok=True, ttft_s=0.2, duration_s=1.0, output_tokens=11)
    assert (b.running, b.kv, b.pending_tokens) == (0, 0.0, 0.0)


def _streaming(p: LatencyPredictor, n: int, *, step_s: float, until: float,
               worker: str = "a", t0: float = 100.0, max_tokens: int = 400) -> None:
    """``n`` answers placed on ``worker`` at ``t0``, first token 0.1 s later, then each
    reporting its progress every 16 tokens at ``step_s`` a token until ``until``."""
    for i in range(n):
        rid = f"s{i}"
        p.place(rid, worker, p.predict(worker, 100, t0), t0, class_name="default",
                max_tokens=max_tokens, tpot_budget_ms=50.0)
        p.first_token(rid, t0 + 0.1)
    tokens, t = 1, t0 + 0.1
    while t + 16 * step_s <= until:
        tokens, t = tokens + 16, t + 16 * step_s
        for i in range(n):
            p.decode_progress(f"s{i}", tokens, t)


def test_the_batch_decodes_no_faster_than_its_answers_were_just_measured_to():
    """A line taught on light loads (20 ms a token here) is no bound on what a fuller
    batch decodes at now: the answers' measured pace is (40 ms here)."""
    p = LatencyPredictor()
    t = teach(p, "a", tpot_ms=20.0)
    line = p.predict("a", 100, t).est_tpot_ms
    assert line == pytest.approx(20.0, rel=0.05)
    _streaming(p, 4, step_s=0.040, until=t + 5.0, t0=t)
    assert p.predict("a", 100, t + 5.0).est_tpot_ms == pytest.approx(40.0, rel=0.05)
    # A pace not reported for PACE_MAX_AGE_S no longer counts (the line, which the
    # first reports taught in between, is then what the step is); nor on another worker.
    base, slope, _ = p.tpot_line("a", t + 9.0)
    by_line = base + slope * (p.workers["a"].kv + 100) / 1024
    assert p.predict("a", 100, t + 9.0).est_tpot_ms == pytest.approx(by_line)
    assert by_line < 35.0
    assert p.predict("b", 100, t + 5.0).est_tpot_ms < 35.0


def test_a_running_answer_is_judged_on_its_measured_pace():
    """An answer measured at 45 ms a token against a 50 ms target has little of its
    budget left for new prompts' prefills, whatever the line says its step is."""
    fast, slow = LatencyPredictor(), LatencyPredictor()
    for p, step_s in ((fast, 0.020), (slow, 0.045)):
        t = teach(p, "a", tpot_ms=20.0)
        _streaming(p, 1, step_s=step_s, until=t + 3.0, t0=t, max_tokens=200)
    slack_fast = fast.running_slack_ms("a", fast.progress["s0"][1])
    slack_slow = slow.running_slack_ms("a", slow.progress["s0"][1])
    # 199 tokens at 50 ms: 9,950 ms of budget.  At 20 ms a token about 60% of it is left;
    # at 45 ms, what its measured tokens and the rest at 45 ms leave: about 10%.
    assert slack_fast == pytest.approx(9950 - 199 * 20.0 - 100, rel=0.05)
    assert slack_slow == pytest.approx(9950 - 199 * 45.0 - 100, rel=0.15)
