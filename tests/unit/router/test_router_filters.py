"""Table tests of the built-in filters."""

from __future__ import annotations

import pytest
from splitserve.components.router.plugins import healthy, kv_headroom, queue_limit

from .router_factories import request, snapshot, worker

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("state", "kept", "reason"), [
    ({}, True, None),
    ({"healthy": False}, False, "unhealthy"),
    ({"draining": True}, False, "draining"),
    ({"healthy": False, "draining": True}, False, "unhealthy"),
    ({"last_seen_s": 10.0}, True, None),
    ({"last_seen_s": 10.5}, False, "stale: last seen 10.5s ago > 10s"),
])
def test_healthy_filter(state, kept, reason):
    workers = [worker(1, **state), worker(2)]
    result = healthy.HealthyFilter(healthy.Params(max_age_s=10.0)).filter(
        request(), snapshot(*workers), workers)
    assert [w.worker_id for w in result.kept] == ([1, 2] if kept else [2])
    assert result.removed == ({} if kept else {1: reason})


@pytest.mark.parametrize(("used", "limit", "kept", "removed", "note"), [
    ([10, 50, 90], 0.8, [1, 2], {3: "KV usage 0.90 > 0.8"}, ""),
    ([80, 50], 0.8, [1, 2], {}, ""),                       # at the limit stays
    ([81, 99], 0.8, [1, 2], {}, "all 2 workers above KV usage 0.8; kept all"),
    ([100, 0], 1.0, [1, 2], {}, ""),
])
def test_kv_headroom_filter(used, limit, kept, removed, note):
    workers = [worker(i + 1, kv_blocks_used=u) for i, u in enumerate(used)]
    result = kv_headroom.KvHeadroomFilter(kv_headroom.Params(max_kv_usage=limit)).filter(
        request(), snapshot(*workers), workers)
    assert [w.worker_id for w in result.kept] == kept
    assert result.removed == removed
    assert result.note == note


def test_kv_headroom_treats_unknown_capacity_as_empty():
    workers = [worker(1, kv_blocks_total=0, kv_blocks_used=0)]
    result = kv_headroom.KvHeadroomFilter(kv_headroom.Params(max_kv_usage=0.5)).filter(
        request(), snapshot(*workers), workers)
    assert [w.worker_id for w in result.kept] == [1]


@pytest.mark.parametrize(("waiting", "kept"), [
    ([0, 3, 4], [1, 2]),
    ([4, 9], []),            # a hard limit: nobody left is a valid outcome
    ([], []),
])
def test_queue_limit_filter(waiting, kept):
    workers = [worker(i + 1, waiting_requests=n) for i, n in enumerate(waiting)]
    result = queue_limit.QueueLimitFilter(queue_limit.Params(max_waiting_requests=4)).filter(
        request(), snapshot(*workers), workers)
    assert [w.worker_id for w in result.kept] == kept
    assert set(result.removed) == {w.worker_id for w in workers} - set(kept)
