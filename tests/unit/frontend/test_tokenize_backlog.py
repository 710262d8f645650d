"""The tokenizer pool's queue is bounded by the wait it implies, not by a count alone."""

import pytest

from splitserve.components.frontend.backlog import TokenizeBacklog


def test_a_burst_of_short_prompts_is_taken_whole():
    b = TokenizeBacklog(threads=2, max_wait_s=2.0, max_pending=1024, bytes_per_s=5e6)
    for _ in range(300):  # 300 x 30 KB at 5 MB/s on 2 threads: 0.9 s of work
        assert b.refusal(30_000) is None
        b.enter(30_000)
    assert b.expected_wait_s() == pytest.approx(0.9)


def test_long_prompts_are_refused_once_the_wait_passes_the_limit():
    b = TokenizeBacklog(threads=2, max_wait_s=2.0, max_pending=1024, bytes_per_s=5e6)
    taken = 0
    while b.refusal(400_000) is None:  # ~100k-token prompts, 80 ms each
        b.enter(400_000)
        taken += 1
    assert taken == 50  # 50 x 400 KB = 20 MB = 2 s on 2 threads at 5 MB/s each
    assert "limit 2s" in b.refusal(400_000)


def test_one_request_is_always_taken_when_nothing_waits():
    b = TokenizeBacklog(threads=1, max_wait_s=0.1, max_pending=8, bytes_per_s=1e6)
    assert b.refusal(10_000_000) is None


def test_the_count_cap_stays_a_backstop():
    b = TokenizeBacklog(threads=2, max_wait_s=100.0, max_pending=3)
    for _ in range(3):
        b.enter(10)
    assert "3 requests" in b.refusal(10)


def test_the_rate_is_learned_from_finished_requests():
    b = TokenizeBacklog(threads=1, max_wait_s=2.0, max_pending=10, bytes_per_s=20e6)
    for _ in range(40):
        b.enter(100_000)
        b.leave(100_000, busy_s=0.05)  # 2 MB/s measured
    assert b.bytes_per_s == pytest.approx(2e6, rel=0.01)
    assert (b.pending, b.pending_bytes) == (0, 0)
    b.leave(1, None)  # a failure before measuring changes no rate and never goes negative
    assert b.pending == 0 and b.bytes_per_s == pytest.approx(2e6, rel=0.01)
