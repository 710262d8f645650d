"""The stall guard: a local prefill that would push an answer decoding in its batch over
its TPOT budget goes remote; one every answer absorbs stays local."""

from __future__ import annotations

import pytest

from splitserve.components.worker.stall_guard import PROTECTS, StallGuard

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def decoding(guard: StallGuard, clock: Clock, rid: str, max_tokens: int, step_s: float,
             tokens: int, local: bool = True) -> None:
    """Answer ``rid`` has ``tokens`` tokens, one every ``step_s``; the clock ends at its
    last one."""
    guard.begin(rid, max_tokens, local=local)
    for i in range(tokens):
        if i:
            clock.t += step_s
        guard.token(rid, 1)


def test_no_budget_or_nothing_learnt_keeps_the_verdict():
    clock = Clock()
    assert StallGuard(now=clock).judge(4000, None).reason == "off"
    guard = StallGuard(now=clock)
    decoding(guard, clock, "a", 100, 0.04, 2)
    assert guard.judge(4000, 0.05).reason == "no-rate" and guard.judge(4000, 0.05).keep_local
    guard.observe_prefill(32, 1.0)  # too few tokens to say anything about speed
    assert guard.seconds_per_token is None


def test_a_stall_an_answer_cannot_absorb_sends_the_prefill_remote():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 3.0)  # 3 ms a token
    decoding(guard, clock, "a", 100, 0.04, 2)
    # a: 0.04 s so far, 98 tokens left at 0.04 s -> 3.96 s of 99 * 0.05 = 4.95 s allowed
    small = guard.judge(300, 0.05)  # 0.9 s: fits
    assert small.keep_local and small.reason == "fits"
    big = guard.judge(400, 0.05)  # 1.2 s: 5.16 s > 4.95 s
    assert not big.keep_local and big.reason == PROTECTS and big.harmed == 1
    assert big.stall_s == pytest.approx(1.2)
    guard.end("a")
    assert guard.judge(400, 0.05).keep_local and len(guard) == 0


def test_an_answer_already_over_its_budget_is_not_protected():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 3.0)
    decoding(guard, clock, "late", 10, 0.08, 3)  # 0.08 s a token against 0.05 s
    assert guard.judge(4000, 0.05).keep_local


def test_local_prefills_queued_ahead_are_charged_to_the_answers():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 1.0)  # 1 ms a token
    decoding(guard, clock, "a", 100, 0.04, 2)
    assert guard.judge(900, 0.05).keep_local  # 3.96 + 0.9 <= 4.95
    guard.begin("queued", 50, local=True, prefill_tokens=500)  # 0.5 s ahead of the next
    judged = guard.judge(900, 0.05)
    assert not judged.keep_local and judged.harmed == 1
    guard.token("queued", 1)  # its prefill is done: nothing ahead any more
    assert guard.judge(900, 0.05).keep_local


def test_a_separate_local_batch_protects_only_the_answers_prefilled_here():
    clock = Clock()
    guard = StallGuard(own_local_batch=True, now=clock)
    guard.observe_prefill(1000, 3.0)
    decoding(guard, clock, "remote", 100, 0.04, 2, local=False)
    assert guard.judge(400, 0.05).keep_local
    guard.own_local_batch = False  # one batch: the remote answer shares it
    assert not guard.judge(400, 0.05).keep_local


def test_an_answer_of_one_token_so_far_is_judged_at_the_learnt_step():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 3.0)
    decoding(guard, clock, "done", 10, 0.045, 10)
    guard.end("done")
    assert guard.step_s == pytest.approx(0.045)
    decoding(guard, clock, "new", 100, 0.0, 1)  # 99 tokens left at 0.045 s: 4.455 s
    assert guard.judge(100, 0.05).keep_local  # + 0.3 s <= 4.95 s
    assert not guard.judge(200, 0.05).keep_local  # + 0.6 s > 4.95 s


def test_the_prefill_speed_is_a_moving_mean():
    guard = StallGuard()
    guard.observe_prefill(1000, 1.0)
    guard.observe_prefill(1000, 2.0)
    assert guard.seconds_per_token == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)


def test_local_prefills_teach_their_speed_first_come_first_served():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 5.0)  # the prior: 5 ms a token
    guard.begin("p1", 10, local=True, prefill_tokens=1000)
    guard.begin("p2", 10, local=True, prefill_tokens=1000)  # waits behind p1
    clock.t = 1.0
    guard.token("p1", 1)  # 1 s for its 1,000 tokens
    assert guard.seconds_per_token == pytest.approx(0.001)
    clock.t = 3.0
    guard.token("p2", 1)  # served from 1 s to 3 s: 2 ms a token, not 3
    assert guard.local_spt == pytest.approx(0.8 * 0.001 + 0.2 * 0.002)
    guard.begin("short", 10, local=True, prefill_tokens=10)
    clock.t = 4.0
    guard.token("short", 1)  # too few tokens to learn from
    assert guard.local_spt == pytest.approx(0.0012)


def test_an_answer_still_prefilling_here_is_protected_from_prompts_after_it():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 1.0)  # 1 ms a token
    guard.step_s = 0.01
    # waiting: its prefill ends at 2.0 s, then 99 tokens at 10 ms: 0.99 s of 4.95 s
    guard.begin("waiting", 100, local=True, prefill_tokens=2000)
    assert guard.judge(3000, 0.05).keep_local  # 3 s more: 3.99 s
    judged = guard.judge(4500, 0.05)  # 4.5 s more: 5.49 s
    assert not judged.keep_local and judged.harmed == 1


def test_an_answer_carrying_its_class_target_is_protected_to_the_tighter_one():
    clock = Clock()
    guard = StallGuard(now=clock)
    guard.observe_prefill(1000, 3.0)
    decoding(guard, clock, "plain", 100, 0.04, 2)  # no target anywhere: not judged
    assert guard.judge(400, None).reason == "off"
    guard.begin("classed", 100, local=True, budget_s=0.05)
    guard.token("classed", 1)
    clock.t += 0.04
    guard.token("classed", 1)
    judged = guard.judge(400, None)  # as in the section's case above: 5.16 s > 4.95 s
    assert not judged.keep_local and judged.harmed == 1
    # a looser section target: the class's tighter one holds
    assert guard.judge(400, 0.2).harmed == 1
    guard.end("classed")
    assert guard.judge(400, 0.2).harmed == 0  # "plain" at the section's 0.2 s fits
    assert guard.judge(400, None).reason == "off"
