"""The prefill queue against a real nats-server with JetStream (embedded, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator

import nats
import pytest

from splitserve.components.prefill_queue import (
    PrefillQueue,
    PrefillQueueConfig,
    PrefillRequest,
    QueueFull,
    QueueUnavailable,
)
from splitserve.infra.embedded import EmbeddedInfra

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

MODEL = "org/Model-1.5B.Instruct"  # needs sanitising: '/' and '.'


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep.nats


def fast_config(**over: object) -> PrefillQueueConfig:
    """Short timings so redelivery and expiry happen within a test's time budget."""
    base: dict[str, object] = {
        "ack_wait_s": 1.0, "max_deliver": 5, "idle_recheck_s": 0.1, "depth_refresh_s": 0.1,
        "request_timeout_s": 1.0, "max_age_s": 30.0, "duplicate_window_s": 5.0,
        "storage": "memory"}
    base.update(over)
    return PrefillQueueConfig.model_validate(base)


def make_request(request_id: str | None = None, **over: object) -> PrefillRequest:
    fields: dict[str, object] = {
        "request_id": request_id or uuid.uuid4().hex, "token_ids": list(range(1, 40)),
        "decode_worker_id": "decode-0",
        "destination": {"nixl_agent": "decode-0-agent", "block_ids": [3, 7, 9],
                        "block_size": 16}, "enqueued_at": time.time(),
        "max_wait_s": 30.0}
    fields.update(over)
    return PrefillRequest.model_validate(fields)


def namespace() -> str:
    """A fresh namespace per test, so every test has its own stream."""
    return f"test ns/{uuid.uuid4().hex[:8]}"


async def wait_until(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    """Poll an async predicate until true; returns seconds waited, fails after timeout_s."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(step_s)
    return time.monotonic() - start


async def depth_at(q: PrefillQueue, total: int, timeout_s: float = 5.0):
    """The depth once it counts ``total`` jobs: the server counts a consumer's pending
    messages as its stream signals them, shortly after the publish was acknowledged."""
    start = time.monotonic()
    while (depth := await q.depth()).total != total:
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"depth {depth} never reached {total} within {timeout_s}s")
        await asyncio.sleep(0.02)
    return depth


@pytest.mark.asyncio
async def test_enqueue_pull_ack(nats_url: str) -> None:
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        sent = make_request("r1")
        result = await q.enqueue(sent)
        assert result.level == 1 and not result.duplicate
        assert (await depth_at(q, 1)).waiting == (0, 1, 0)
        [job] = await q.pull(wait_s=2.0)
        assert job.request == sent and job.delivery_count == 1 and job.level == 1
        assert (await depth_at(q, 1)).in_flight == (0, 1, 0)
        await job.ack()
        assert (await depth_at(q, 0)).total == 0
        assert await q.pull(wait_s=0.2) == []
        assert (q.stats.enqueued, q.stats.delivered, q.stats.acked) == (1, 1, 1)


@pytest.mark.asyncio
async def test_a_retried_enqueue_is_stored_once(nats_url: str) -> None:
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        job = make_request("same")
        first = await q.enqueue(job)
        again = await q.enqueue(job)
        assert again.duplicate and again.stream_seq == first.stream_seq
        assert (await depth_at(q, 1)).total == 1


@pytest.mark.asyncio
async def test_the_same_request_enqueued_again_is_a_new_job(nats_url: str) -> None:
    """A request resumed after its worker was lost (a longer prompt), or resent whole to
    another decode worker, keeps its request id: each enqueue is its own job."""
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        first = await q.enqueue(make_request("same"))
        resumed = await q.enqueue(make_request("same", token_ids=list(range(1, 45))))
        resent = await q.enqueue(make_request("same", decode_worker_id="decode-1"))
        assert not resumed.duplicate and not resent.duplicate
        assert len({first.stream_seq, resumed.stream_seq, resent.stream_seq}) == 3
        assert (await depth_at(q, 3)).total == 3


@pytest.mark.asyncio
async def test_two_workers_share_work_each_message_once(nats_url: str) -> None:
    ns, cfg = namespace(), fast_config()
    async with (await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as producer,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as w1,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as w2):
        ids = [f"r{i}" for i in range(20)]
        for rid in ids:
            await producer.enqueue(make_request(rid))
        done: dict[str, list[str]] = {"w1": [], "w2": []}

        async def work(name: str, q: PrefillQueue) -> None:
            while jobs := await q.pull(wait_s=0.3):
                for job in jobs:
                    await asyncio.sleep(0.01)  # "prefill"
                    await job.ack()
                    done[name].append(job.request.request_id)

        await asyncio.wait_for(asyncio.gather(work("w1", w1), work("w2", w2)), 10)
        processed = done["w1"] + done["w2"]
        assert sorted(processed) == sorted(ids)  # each exactly once
        assert done["w1"] and done["w2"]
        assert (await depth_at(producer, 0)).total == 0


@pytest.mark.asyncio
async def test_dead_worker_job_is_redelivered_after_ack_wait(nats_url: str) -> None:
    ns, cfg = namespace(), fast_config(ack_wait_s=1.0)
    async with (await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as producer,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as survivor):
        dying = await PrefillQueue.connect(nats_url, ns, MODEL, cfg)
        await producer.enqueue(make_request("r-dead"))
        assert len(await dying.pull(wait_s=2.0)) == 1
        await dying.close()  # the worker dies holding the job: no ack, no nak
        start = time.monotonic()
        [job] = await survivor.pull(wait_s=5.0)
        waited = time.monotonic() - start
        assert job.request.request_id == "r-dead" and job.delivery_count == 2
        assert 0.5 <= waited <= 3.0
        assert survivor.stats.redelivered == 1
        await job.ack()
        assert (await depth_at(producer, 0)).total == 0


@pytest.mark.asyncio
async def test_in_progress_keeps_a_long_job_from_redelivery(nats_url: str) -> None:
    ns, cfg = namespace(), fast_config(ack_wait_s=1.0)
    async with (await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as busy,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as other):
        await busy.enqueue(make_request("long"))
        [job] = await busy.pull(wait_s=2.0)
        for _ in range(4):  # 1.6 s of "prefill", longer than ack_wait
            await asyncio.sleep(0.4)
            await job.in_progress()
        assert await other.pull(wait_s=0.2) == []
        await job.ack()
        assert other.stats.delivered == 0


@pytest.mark.asyncio
async def test_full_queue_rejects_quickly(nats_url: str) -> None:
    cfg = fast_config(max_msgs=2)
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, cfg) as q:
        await q.enqueue(make_request())
        await q.enqueue(make_request(priority="low"))
        start = time.monotonic()
        with pytest.raises(QueueFull):
            await q.enqueue(make_request(priority="high"))
        assert time.monotonic() - start < 0.5
        assert (q.stats.enqueued, q.stats.rejected_full) == (2, 1)
        [job] = await q.pull(wait_s=1.0)
        await job.ack()
        await q.enqueue(make_request())  # room again after an ack


@pytest.mark.asyncio
async def test_full_by_bytes_rejects_quickly(nats_url: str) -> None:
    cfg = fast_config(max_bytes=4096)
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, cfg) as q:
        big = {"token_ids": list(range(500)),
               "destination": {"nixl_agent": "decode-0-agent", "block_ids": list(range(40)),
                               "block_size": 16}}
        await q.enqueue(make_request(**big))
        with pytest.raises(QueueFull):
            await q.enqueue(make_request(**big))


@pytest.mark.asyncio
async def test_max_age_deletes_old_requests(nats_url: str) -> None:
    cfg = fast_config(max_age_s=1.0, duplicate_window_s=0.5)
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, cfg) as q:
        start = time.monotonic()
        await q.enqueue(make_request())

        async def stored() -> int:
            # The stream's count changes with the publish's ack; the consumers' pending
            # counts (``depth``) follow a moment later, and read 0 right after a publish.
            return (await q._js.stream_info(q.names.stream)).state.messages

        assert await stored() == 1

        async def aged_out() -> bool:
            return await stored() == 0 and (await q.depth()).total == 0

        await wait_until(aged_out, timeout_s=5.0)
        assert time.monotonic() - start >= 0.5
        assert await q.pull(wait_s=0.2) == []


@pytest.mark.asyncio
async def test_high_priority_is_pulled_first(nats_url: str) -> None:
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        for rid, prio in [("low-1", "low"), ("def-1", "default"), ("low-2", 2),
                          ("high-1", "high"), ("def-2", "batch"), ("high-2", 0)]:
            await q.enqueue(make_request(rid, priority=prio))
        order = []
        while jobs := await q.pull(wait_s=0.3):
            for job in jobs:
                order.append(job.request.request_id)
                await job.ack()
        assert order == ["high-1", "high-2", "def-1", "def-2", "low-1", "low-2"]
        # A batch fills from the top level down.
        for rid, prio in [("l", "low"), ("d", "default"), ("h", "high")]:
            await q.enqueue(make_request(rid, priority=prio))
        batch = await q.pull(batch=2, wait_s=1.0)
        assert [j.request.request_id for j in batch] == ["h", "d"]


@pytest.mark.asyncio
async def test_depth_monitor_tracks_depth_within_refresh(nats_url: str) -> None:
    cfg = fast_config(depth_refresh_s=0.1)
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, cfg) as q:
        monitor = q.depth_monitor()
        await monitor.start()
        try:
            assert monitor.depth == 0
            for _ in range(3):
                await q.enqueue(make_request())

            async def seen(n: int) -> bool:
                return monitor.depth == n

            assert await wait_until(lambda: seen(3), timeout_s=1.0, step_s=0.02) <= 0.5
            assert monitor.age_s is not None and monitor.age_s < 0.3
            for job in await q.pull(batch=3, wait_s=1.0):
                await job.ack()
            assert await wait_until(lambda: seen(0), timeout_s=1.0, step_s=0.02) <= 0.5
        finally:
            await monitor.stop()


@pytest.mark.asyncio
async def test_malformed_and_expired_are_dropped_and_counted(nats_url: str) -> None:
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            subject = q.names.subjects[0]
            await js.publish(subject, b"not json")
            await js.publish(subject, b'{"version": 3, "request_id": "future"}')
            await js.publish(subject, b'{"version": 1, "request_id": "no-tokens"}')
        finally:
            await nc.close()
        await q.enqueue(make_request("stale", enqueued_at=time.time() - 60, max_wait_s=5.0))
        await q.enqueue(make_request("good"))
        [job] = await q.pull(wait_s=2.0)
        assert job.request.request_id == "good"
        await job.ack()
        s = q.stats
        assert (s.malformed, s.terminated, s.expired, s.delivered) == (3, 3, 1, 5)
        assert s.as_dict()["dropped_bad_shape"] == 2
        assert s.as_dict()["dropped_unknown_version"] == 1
        assert s.as_dict()["dropped_expired"] == 1
        assert (await depth_at(q, 0)).total == 0  # terminated and expired are gone for good


@pytest.mark.asyncio
async def test_missing_stream_rejects_quickly_as_unavailable(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        q = PrefillQueue(nc, namespace(), MODEL, fast_config())  # ensure() never called
        start = time.monotonic()
        with pytest.raises(QueueUnavailable):
            await q.enqueue(make_request())
        assert time.monotonic() - start < 1.5
        assert q.stats.rejected_unavailable == 1
        await q.close()
    finally:
        await nc.close()


@pytest.mark.asyncio
async def test_jobs_iterator_serves_a_worker_loop(nats_url: str) -> None:
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL, fast_config()) as q:
        for rid in ("a", "b", "c"):
            await q.enqueue(make_request(rid))
        seen = []

        async def loop() -> None:
            async for job in q.jobs(poll_s=0.2):
                seen.append(job.request.request_id)
                await job.ack()
                if len(seen) == 3:
                    return

        await asyncio.wait_for(loop(), 5)
        assert seen == ["a", "b", "c"]


@pytest.mark.asyncio
async def test_a_late_answer_neither_lets_a_lower_level_overtake_nor_is_misread(
        nats_url: str) -> None:
    """The server's answer to the high level's pull request comes after
    ``request_timeout_s`` (here: the request is sent late): that scan takes nothing
    rather than the low job, and the high job is served first afterwards."""
    async with await PrefillQueue.connect(nats_url, namespace(), MODEL,
                                          fast_config(request_timeout_s=0.3)) as q:
        await q.enqueue(make_request("l", priority="low"))
        await q.enqueue(make_request("h", priority="high"))
        nc, publish = q._nc, q._nc.publish
        delayed = []

        async def late_high_pull(subject, payload=b"", reply="", headers=None):
            if subject.endswith(q.names.consumers[0]) and not delayed:
                delayed.append(asyncio.get_running_loop().call_later(
                    0.6, lambda: asyncio.ensure_future(publish(subject, payload, reply=reply))))
                return None
            return await publish(subject, payload, reply=reply, headers=headers)

        nc.publish = late_high_pull
        try:
            assert await q.pull(batch=1, wait_s=0) == []
        finally:
            nc.publish = publish
        assert q.stats.pull_timeouts == 1
        await asyncio.sleep(0.5)  # the late answer arrives: read by nobody
        order = []
        while len(order) < 2:
            jobs = await q.pull(batch=1, wait_s=3.0)  # h again after ack_wait_s (1 s)
            assert jobs, order
            for job in jobs:
                order.append(job.request.request_id)
                await job.ack()
        assert order == ["h", "l"]


@contextlib.asynccontextmanager
async def producer_and_two_workers(nats_url: str, **config: object):
    """A decode-side queue and prefill workers "a1" and "b2" on a fresh stream."""
    ns, cfg = namespace(), fast_config(**config)
    async with (await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as producer,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg, worker="a1") as a,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg, worker="b2") as b):
        yield producer, a, b


@pytest.mark.asyncio
async def test_a_job_queued_for_a_worker_is_its_own_before_the_shared_ones(
        nats_url: str) -> None:
    async with producer_and_two_workers(nats_url, steal_after_s=30.0) as (producer, a, b):
        await producer.enqueue(make_request("shared-1"))
        await producer.enqueue(make_request("for-a"), worker="a1")
        await producer.enqueue(make_request("shared-2"))
        depth = await depth_at(producer, 3)
        assert depth.total == 3 and depth.waiting == (0, 3, 0)
        assert depth.by_worker == {"a1": 1, "b2": 0}
        # b never sees a's job (not waited long enough); it takes the shared ones
        got_b = [j for _ in range(3) for j in await b.pull(wait_s=0.2)]
        assert [j.request.request_id for j in got_b] == ["shared-1", "shared-2"]
        assert [j.source for j in got_b] == ["shared", "shared"]
        [job] = await a.pull(wait_s=1.0)
        assert job.request.request_id == "for-a" and job.source == "own"
        await job.ack()
        for j in got_b:
            await j.ack()
        assert (await depth_at(producer, 0)).total == 0


@pytest.mark.asyncio
async def test_own_jobs_come_first_within_a_level_never_above_a_higher_one(
        nats_url: str) -> None:
    ns, cfg = namespace(), fast_config(steal_after_s=30.0)
    async with (await PrefillQueue.connect(nats_url, ns, MODEL, cfg) as producer,
                await PrefillQueue.connect(nats_url, ns, MODEL, cfg, worker="a1") as a):
        await producer.enqueue(make_request("low-shared", priority="low"))
        await producer.enqueue(make_request("default-shared"))
        await producer.enqueue(make_request("default-own"), worker="a1")
        await producer.enqueue(make_request("high-shared", priority="high"))
        jobs = await a.pull(batch=4, wait_s=1.0)
        assert [j.request.request_id for j in jobs] == [
            "high-shared", "default-own", "default-shared", "low-shared"]
        for j in jobs:
            await j.ack()


@pytest.mark.asyncio
async def test_a_job_left_waiting_by_its_worker_is_stolen_by_an_idle_one(
        nats_url: str) -> None:
    async with producer_and_two_workers(nats_url, steal_after_s=0.6) as (producer, a, b):
        del a  # a1 is busy (or gone): it never pulls
        await producer.enqueue(make_request("for-a"), worker="a1")
        assert await b.pull(wait_s=0.3) == []  # too young to take
        start = time.monotonic()
        jobs: list = []
        while not jobs and time.monotonic() - start < 5:
            jobs = await b.pull(wait_s=0.3)
        [job] = jobs
        assert job.request.request_id == "for-a" and job.source == "stolen"
        assert b.stats.stolen == 1
        await job.ack()
        assert (await depth_at(producer, 0)).total == 0
        # a worker never steals its own jobs: they are its own
        await producer.enqueue(make_request("for-b"), worker="b2")
        [own] = await b.pull(wait_s=1.0)
        assert own.source == "own"
        await own.ack()
