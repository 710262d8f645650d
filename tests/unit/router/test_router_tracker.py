"""RecentPrefixTracker: leading-run counts, TTL expiry and the capacity bound."""

from __future__ import annotations

import pytest
from splitserve.components.router import RecentPrefixTracker

pytestmark = pytest.mark.unit


def tracker_with(records: list[tuple[int, list[int], float]], ttl_s: float = 5.0,
                 capacity: int = 1000) -> RecentPrefixTracker:
    """A tracker after recording (worker, block hashes, time) in order."""
    tracker = RecentPrefixTracker(ttl_s=ttl_s, capacity=capacity)
    for worker_id, blocks, now in records:
        tracker.record(worker_id, blocks, now)
    return tracker


@pytest.mark.parametrize(("records", "query", "now", "expected"), [
    ([(1, [10, 11, 12], 0.0)], [10, 11, 12, 13], 1.0, {1: 3}),
    ([(1, [10, 11, 12], 0.0), (2, [10, 11], 0.5)], [10, 11, 12], 1.0, {1: 3, 2: 2}),
    ([(1, [11, 12], 0.0)], [10, 11, 12], 1.0, {}),              # only a leading run counts
    ([(1, [10, 12], 0.0)], [10, 11, 12], 1.0, {1: 1}),
    ([(1, [10, 11], 0.0)], [10, 11], 5.0, {}),                   # expired at exactly the TTL
    ([(1, [10, 11], 0.0), (1, [10], 4.0)], [10, 11], 6.0, {1: 1}),  # refresh keeps 10 only
    ([], [10], 0.0, {}),
    ([(1, [10], 0.0)], [], 0.0, {}),
])
def test_recent_blocks(records, query, now, expected):
    assert tracker_with(records).recent_blocks(query, now) == expected


def test_capacity_evicts_oldest_pairs():
    tracker = tracker_with([(1, [10, 11], 0.0), (2, [10, 11], 1.0)], capacity=3)
    assert len(tracker) == 3
    assert tracker.recent_blocks([10, 11], 1.5) == {2: 2}


def test_expired_entries_are_dropped_from_memory():
    tracker = tracker_with([(1, [1, 2, 3], 0.0), (2, [4], 3.0)], ttl_s=2.0)
    assert len(tracker) == 1
    tracker.recent_blocks([4], 10.0)
    assert len(tracker) == 0


@pytest.mark.parametrize(("ttl_s", "capacity"), [(0.0, 10), (-1.0, 10), (1.0, 0)])
def test_bad_bounds_are_rejected(ttl_s, capacity):
    with pytest.raises(ValueError):
        RecentPrefixTracker(ttl_s=ttl_s, capacity=capacity)
