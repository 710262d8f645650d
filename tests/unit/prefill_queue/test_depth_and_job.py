"""QueueDepthMonitor with a fake depth source, and PrefillJob settling a fake message."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.prefill_queue import (
    PrefillJob,
    PrefillQueueStats,
    QueueDepth,
    QueueDepthMonitor,
)

from .factories import make_request

pytestmark = pytest.mark.unit


class FakeSource:
    """Returns depths from a list; raises when the next item is an exception."""

    def __init__(self, *items: int | Exception) -> None:
        self.items = list(items)
        self.calls = 0

    async def __call__(self) -> QueueDepth:
        self.calls += 1
        item = self.items.pop(0) if len(self.items) > 1 else self.items[0]
        if isinstance(item, Exception):
            raise item
        return QueueDepth(waiting=(item, 0), in_flight=(0, 1), measured_at=self.calls)


def test_depth_totals() -> None:
    d = QueueDepth(waiting=(1, 2), in_flight=(3, 4), measured_at=0.0)
    assert d.per_level == (4, 6) and d.total == 10


@pytest.mark.asyncio
async def test_monitor_reads_without_io_and_reports_age() -> None:
    clock = [10.0]
    monitor = QueueDepthMonitor(FakeSource(4), refresh_s=1.0, clock=lambda: clock[0])
    assert monitor.depth is None and monitor.age_s is None
    await monitor.refresh()
    clock[0] = 12.5
    assert monitor.depth == 5 and monitor.age_s == pytest.approx(11.5)


@pytest.mark.asyncio
async def test_monitor_refreshes_in_background_and_survives_errors() -> None:
    source = FakeSource(1, RuntimeError("nats down"), 7)
    monitor = QueueDepthMonitor(source, refresh_s=0.01)
    await monitor.start()
    assert monitor.depth == 2
    for _ in range(200):
        if monitor.depth == 8:
            break
        await asyncio.sleep(0.01)
    await monitor.stop()
    assert monitor.depth == 8 and monitor.errors == 1
    calls = source.calls
    await asyncio.sleep(0.05)
    assert source.calls == calls  # stopped


def test_monitor_rejects_bad_interval() -> None:
    with pytest.raises(ValueError):
        QueueDepthMonitor(FakeSource(0), refresh_s=0)


class FakeMsg:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def ack_sync(self, timeout: float = 1.0) -> object:  # noqa: ASYNC109 - nats-py's
        self.calls.append(("ack", timeout))
        return self

    async def nak(self, delay: float | None = None) -> None:
        self.calls.append(("nak", delay))

    async def in_progress(self) -> None:
        self.calls.append(("wip", None))

    async def term(self) -> None:
        self.calls.append(("term", None))


@pytest.mark.asyncio
@pytest.mark.parametrize("action, expected_call, counter", [
    ("ack", ("ack", 0.5), "acked"),
    ("nak", ("nak", None), "naked"),
    ("term", ("term", None), "terminated"),
])
async def test_job_settles_and_counts(action: str, expected_call: tuple, counter: str) -> None:
    msg, stats = FakeMsg(), PrefillQueueStats()
    job = PrefillJob(make_request(), msg, level=1, delivery_count=2, stats=stats,
                     ack_timeout_s=0.5)
    await job.in_progress()
    await getattr(job, action)()
    assert msg.calls == [("wip", None), expected_call]
    assert job.settled and getattr(stats, counter) == 1
    assert "delivery_count=2" in repr(job)


def test_stats_flatten_for_export() -> None:
    stats = PrefillQueueStats(enqueued=3)
    stats.dropped_by_reason["bad-shape"] += 2
    flat = stats.as_dict()
    assert flat["enqueued"] == 3 and flat["dropped_bad_shape"] == 2
    assert all(isinstance(v, int) for v in flat.values())
