"""The prefill loop takes jobs by the prompt tokens it has in flight, one at a time, so a
burst spreads over every prefill worker instead of queueing inside the first that pulled."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.worker import prefill_loop
from splitserve.components.worker.prefill_loop import PrefillLoopSettings, pull_loop
from tests.unit.prefill_queue.factories import FakeJob

pytestmark = [pytest.mark.unit]


class Queue:
    """Hands out its jobs in order, recording each pull's batch size."""

    def __init__(self, sizes: list[int]) -> None:
        self.jobs = [FakeJob(request_id=f"r{i}", token_ids=list(range(1, n + 1)),
                             destination=None) for i, n in enumerate(sizes)]
        self.batches: list[int] = []

    async def pull(self, batch: int = 1, wait_s: float = 1.0):
        self.batches.append(batch)
        if not self.jobs:
            await asyncio.sleep(0.01)
            return []
        taken, self.jobs = self.jobs[:batch], self.jobs[batch:]
        return taken


@pytest.fixture
def running(monkeypatch):
    """Jobs the loop started, each finishing when its event is set."""
    started: dict[str, asyncio.Event] = {}

    async def prefill_one(engine, nc, job, settings, worker_id, metrics):
        done = started[job.request.request_id] = asyncio.Event()
        await done.wait()
        return "done"

    monkeypatch.setattr(prefill_loop, "prefill_one", prefill_one)
    return started


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def bound(jobs: int = 16, tokens: int = 16384) -> PrefillLoopSettings:
    return PrefillLoopSettings(max_concurrent_jobs=jobs, max_inflight_tokens=tokens,
                               drain_timeout_s=0.1)


async def run_until(queue: Queue, settings: PrefillLoopSettings, step) -> None:
    stopping = asyncio.Event()
    loop = asyncio.create_task(pull_loop(None, None, queue, settings, 1, None, stopping))
    try:
        await step()
    finally:
        stopping.set()
        await asyncio.wait_for(loop, 5)


@pytest.mark.asyncio
async def test_a_worker_stops_taking_jobs_once_its_tokens_in_flight_reach_the_bound(running):
    queue, settings = Queue([6000] * 8), bound()

    async def step():
        await settle()
        # 6,000 + 6,000 < 16,384: a third job is taken, then none while 18,000 are in flight
        assert sorted(running) == ["r0", "r1", "r2"]
        assert set(queue.batches) == {1}
        running["r0"].set()
        await settle()
        assert sorted(running) == ["r0", "r1", "r2", "r3"]
        assert len(queue.jobs) == 4  # left in the shared queue for another worker
        for ev in running.values():
            ev.set()

    await run_until(queue, settings, step)


@pytest.mark.asyncio
async def test_a_job_larger_than_the_bound_still_runs(running):
    queue, settings = Queue([40000, 100]), bound()

    async def step():
        await settle()
        assert sorted(running) == ["r0"]
        running["r0"].set()
        await settle()
        assert sorted(running) == ["r0", "r1"]
        running["r1"].set()

    await run_until(queue, settings, step)


@pytest.mark.asyncio
async def test_no_token_bound_pulls_up_to_the_job_count_at_once(running):
    queue, settings = Queue([6000] * 8), bound(jobs=5, tokens=0)

    async def step():
        await settle()
        assert len(running) == 5
        assert queue.batches[0] == 5
        for ev in running.values():
            ev.set()

    await run_until(queue, settings, step)


def test_the_token_bound_is_a_prefill_section_field():
    from splitserve.contracts.sections import PrefillTimings

    assert PrefillTimings().max_inflight_tokens == 16384
    with pytest.raises(ValueError, match="max_inflight_tokens"):
        PrefillTimings(max_inflight_tokens=-1)
