"""The admission queue's core: least slack first, first come first served within a
deadline, doomed requests shed, bounded."""

from __future__ import annotations

import pytest

from splitserve.components.router.qos.slack_queue import QueueConfig, SlackQueue

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("pushes,now,expected,doomed", [
    # (name, deadline, sheddable) pushed in order; pop at `now`.
    ([("a", 5.0, True), ("b", 3.0, True)], 0.0, "b", []),            # least slack first
    ([("a", 3.0, True), ("b", 3.0, True)], 0.0, "a", []),            # same deadline: FIFO
    ([("a", 1.0, True), ("b", 3.0, True)], 2.0, "b", ["a"]),         # a is doomed: shed
    ([("a", 1.0, False), ("b", 3.0, True)], 2.0, "a", []),           # never shed if may not
    ([("a", 1.0, True), ("b", 1.5, True)], 2.0, None, ["a", "b"]),   # all doomed
    ([], 0.0, None, []),
])
def test_pop_table(pushes, now, expected, doomed):
    q: SlackQueue[str] = SlackQueue(10)
    for name, deadline, sheddable in pushes:
        assert q.push(name, deadline, sheddable)
    item, shed = q.pop(now)
    assert item == expected
    assert shed == doomed


def test_full_queue_refuses_and_remove_frees_a_place():
    q: SlackQueue[str] = SlackQueue(2)
    a, b = "a", "b"
    assert q.push(a, 1.0, True) and q.push(b, 2.0, True)
    assert not q.push("c", 0.5, True)
    assert q.remove(a) and not q.remove(a)
    assert q.push("c", 0.5, True)
    assert q.pop(0.0) == ("c", [])


def test_config_is_off_by_default_and_strict():
    assert QueueConfig().max_inflight_per_worker == 0
    with pytest.raises(ValueError):
        QueueConfig.model_validate({"max_inflight": 2})
