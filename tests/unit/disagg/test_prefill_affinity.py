"""Prefix affinity for remote prefill: the pure choice of the prefill worker a job is
queued for (``components/disagg/affinity.py``)."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from splitserve.components.disagg import PrefillAffinity, block_hashes
from splitserve.contracts.prefill_queue import PrefillAffinityConfig

pytestmark = pytest.mark.unit

BS = 4


def affinity(**over) -> PrefillAffinity:
    return PrefillAffinity(PrefillAffinityConfig(block_size=BS, **over))


def prompt(prefix: int, n: int, salt: int = 0) -> list[int]:
    """``n`` tokens whose first ``prefix`` are shared by every prompt of this test."""
    return list(range(prefix)) + [10_000 + salt * 1000 + i for i in range(n - prefix)]


def test_block_hashes_chain_the_prefix_and_key_the_adapter() -> None:
    a, b = block_hashes(prompt(8, 12, 1), BS), block_hashes(prompt(8, 12, 2), BS)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # the same block after a different prefix is a different block
    assert block_hashes([9, 9, 9, 9, 1, 2, 3, 4], BS)[1] != block_hashes(
        [8, 8, 8, 8, 1, 2, 3, 4], BS)[1]
    assert block_hashes([1, 2, 3], BS) == []  # no whole block
    assert block_hashes(prompt(8, 8), BS, "tuned")[0] != block_hashes(prompt(8, 8), BS)[0]


def test_the_worker_holding_the_prefix_gets_the_job() -> None:
    aff = affinity()
    first = prompt(64, 80, 1)
    aff.computed("a1", aff.hashes(first), len(first))
    second = prompt(64, 80, 2)
    choice = aff.choose(aff.hashes(second), len(second), {"a1", "b2"}, {})
    assert (choice.worker, choice.reason, choice.held_tokens) == ("a1", "held", 64)


def test_no_prefix_held_goes_to_the_shared_queue() -> None:
    aff = affinity()
    aff.computed("a1", aff.hashes(prompt(64, 80, 1)), 80)
    fresh = [50_000 + i for i in range(80)]
    choice = aff.choose(aff.hashes(fresh), 80, {"a1", "b2"}, {})
    assert (choice.worker, choice.reason) == (None, "no-prefix-held")


def test_a_holder_with_more_queued_than_its_hit_saves_is_passed_over() -> None:
    aff = affinity()
    aff.computed("a1", aff.hashes(prompt(16, 80, 1)), 80)  # mean job: 80 tokens
    p = prompt(16, 80, 2)
    # 16 tokens held, 2 jobs of ~80 queued ahead there: cheaper to compute it all elsewhere
    choice = aff.choose(aff.hashes(p), len(p), {"a1", "b2"}, {"a1": 2, "b2": 0}, 0.0)
    assert (choice.worker, choice.reason) == (None, "cheaper-elsewhere")
    # with as much queued on the other, the hit wins again
    choice = aff.choose(aff.hashes(p), len(p), {"a1", "b2"}, {"a1": 2, "b2": 2}, 0.0)
    assert choice.worker == "a1"


def test_jobs_sent_but_not_yet_in_the_depth_reading_count_as_queued() -> None:
    aff = affinity()
    aff.computed("a1", aff.hashes(prompt(16, 80, 1)), 80)
    p = prompt(16, 80, 2)
    for _ in range(2):
        aff.sent("a1")
    assert aff.choose(aff.hashes(p), len(p), {"a1", "b2"}, {}).worker is None
    aff.settled("a1")
    aff.settled("a1")
    aff.settled("a1")  # one too many is harmless
    assert aff.choose(aff.hashes(p), len(p), {"a1", "b2"}, {}).worker == "a1"


def test_only_live_workers_are_chosen_and_the_gone_are_forgotten() -> None:
    aff = affinity()
    p = prompt(64, 80, 1)
    aff.computed("a1", aff.hashes(p), 80)
    assert aff.choose(aff.hashes(p), 80, {"b2"}, {}).worker is None
    assert aff.choose(aff.hashes(p), 80, set(), {}).reason == "no-live-worker"
    aff.forget_except({"b2"})
    assert aff.workers() == {}


def test_memory_is_bounded_least_recently_computed_first() -> None:
    aff = affinity(capacity_tokens=8 * BS)  # 8 blocks per worker
    old, new = prompt(0, 6 * BS, 1), prompt(0, 6 * BS, 2)
    aff.computed("a1", aff.hashes(old), 24)
    aff.computed("a1", aff.hashes(new), 24)
    assert aff.workers() == {"a1": 8}
    assert aff.held(aff.hashes(new), "a1") == 6
    assert aff.held(aff.hashes(old), "a1") == 0  # its first blocks went first


def test_disabled_sends_everything_to_the_shared_queue() -> None:
    aff = affinity(enable=False)
    p = prompt(64, 80, 1)
    aff.computed("a1", aff.hashes(p), 80)
    assert aff.choose(aff.hashes(p), 80, {"a1"}, {}).reason == "off"


def test_the_section_refuses_a_bad_field_by_name() -> None:
    with pytest.raises(ValidationError, match="block_size"):
        PrefillAffinityConfig(block_size=0)
    with pytest.raises(ValidationError, match="capacity"):
        PrefillAffinityConfig(capacity_tokns=5)


def test_a_reading_taken_before_a_job_was_answered_or_sent_is_corrected() -> None:
    aff = affinity()
    aff.computed("a1", aff.hashes(prompt(16, 80, 1)), 80)
    p = prompt(16, 80, 2)
    stamp = aff.sent("a1", now=1.0)
    # the reading at t=2 counts that job; it was answered at t=3: nothing is ahead
    aff.settled("a1", stamp, now=3.0)
    assert aff.ahead("a1", {"a1": 1}, measured_at=2.0, now=3.5) == 0
    assert aff.choose(aff.hashes(p), len(p), {"a1", "b2"}, {"a1": 1}, 2.0, 3.5).worker == "a1"
    # a job sent at t=4 is not in that reading yet: it is ahead
    aff.sent("a1", now=4.0)
    assert aff.ahead("a1", {"a1": 1}, measured_at=2.0, now=4.5) == 1
    # another decode worker's jobs in the reading count as they are
    assert aff.ahead("b2", {"b2": 3}, measured_at=2.0, now=4.5) == 3


def test_least_queued_places_an_unheld_prompt_and_its_followers_on_one_worker() -> None:
    aff = affinity(unheld="least-queued")
    first, follower = prompt(64, 80, 1), prompt(64, 80, 2)
    choice = aff.choose(aff.hashes(first), 80, {"a1", "b2"}, {"a1": 1, "b2": 0}, 0.0, 1.0)
    assert (choice.worker, choice.reason) == ("b2", "least-queued")
    # the coordinator remembers a queued job's blocks under its worker at once
    aff.remember("b2", aff.hashes(first))
    assert aff.choose(aff.hashes(follower), 80, {"a1", "b2"}, {}, 0.0, 1.0).worker == "b2"
    # ties are broken at random among the least queued, never always the first
    picks = {aff.choose(aff.hashes([90_000 + i] * 8), 8, {"a1", "b2"}, {}, 0.0, 1.0).worker
             for i in range(40)}
    assert picks == {"a1", "b2"}


def test_share_messages_round_trip_and_garbage_is_refused():
    from splitserve.components.disagg import read_share, share_message

    assert read_share(share_message("d1", "p2", [1, -2, 3])) == ("d1", "p2", [1, -2, 3])
    for bad in (b"", b"{", b"[]", b'{"from": "d1", "worker": "p2"}',
                b'{"from": "d1", "worker": "", "hashes": []}',
                b'{"from": "d1", "worker": "p2", "hashes": [1.5]}',
                b'{"from": "d1", "worker": "p2", "hashes": [true]}',
                b'{"from": 1, "worker": "p2", "hashes": []}'):
        with pytest.raises(ValueError, match="not a prefix affinity message"):
            read_share(bad)


def test_block_hashes_are_the_same_in_every_process():
    """Decode workers share these hashes: an adapter's name must not go through str's
    per-process hash."""
    import subprocess
    import sys

    code = ("from splitserve.components.disagg import block_hashes;"
            "print(block_hashes(list(range(200)), 64, 'adapter-a'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(200)), 64, "adapter-a"))
    assert block_hashes(list(range(200)), 64, "adapter-a") != block_hashes(
        list(range(200)), 64, "adapter-b") != block_hashes(list(range(200)), 64)
