"""``PrefillQueue``: the NATS JetStream adapter of the prefill work queue.

Layout (see docs/prefill_queue.md): one WorkQueue stream per (namespace, model), one
subject per priority level, and one durable pull consumer per level shared by every
prefill worker.  Workers scan the levels highest first with no-wait pull requests, so a
queued high-priority request is always served before any lower one.  An idle worker
sleeps on a small "bell" subject that ``enqueue`` rings, plus a periodic rescan that
catches redeliveries.

Prefix affinity: a decode worker may queue a job for one prefill worker, the one that
holds most of its prompt's prefix (``enqueue(..., worker=)``), on the subject
``<level subject>.w.<worker>``.  Each prefill worker has its own durable consumer per
level on its subjects and scans, per level, its own jobs before the shared ones.  A job
left unstarted in another worker's queue for ``steal_after_s`` is taken by an idle
worker (``_steal``): the owner is busy, stuck or gone, and nothing is lost with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Self

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from splitserve.contracts import tracing
from splitserve.contracts.prefill_queue import PrefillQueueConfig
from .depth import QueueDepth, QueueDepthMonitor
from .enqueue import Enqueued, QueueFull, QueueUnavailable
from .job import PrefillJob
from splitserve.contracts.prefill_job import PrefillRequest, priority_level, triage
from .naming import QueueNames, queue_names
from .stats import PrefillQueueStats

log = logging.getLogger(__name__)

# JetStream error codes: store limit hit on publish (max_msgs / max_bytes with
# discard=New), and "stream exists with a different configuration" on create.
_ERR_STORE_LIMIT = 10077
_ERR_STREAM_EXISTS = 10058


class PrefillQueue:
    """Producer and consumer side of one queue; share one per process and connection.

    Decode workers call ``enqueue`` and read depth through ``depth_monitor()``; prefill
    workers call ``pull`` or iterate ``jobs()``.  Either side calls ``ensure()`` once at
    start-up (idempotent) so the stream and consumers exist with this configuration.
    """

    def __init__(self, nc: NATS, namespace: str, model: str,
                 config: PrefillQueueConfig | None = None, *, owns_connection: bool = False,
                 wall_clock: Callable[[], float] = time.time,
                 worker: str | None = None) -> None:
        self.config = config or PrefillQueueConfig()
        self.names: QueueNames = queue_names(namespace, model, len(self.config.priorities))
        self.worker = worker
        """The prefill worker this client pulls for (its id in hex), which has its own
        consumers for the jobs queued for it; None: a decode worker, or a worker that
        takes shared jobs only."""
        # Per level, the consumers a pull scans in order: this worker's own, then shared.
        self._scan_order: tuple[tuple[str, ...], ...] = tuple(
            ((self.names.worker_consumer(level, worker),) if worker else ()) + (shared,)
            for level, shared in enumerate(self.names.consumers))
        self._next_steal = 0.0
        self.stats = PrefillQueueStats()
        self._nc = nc
        self._js = nc.jetstream(timeout=self.config.request_timeout_s)
        self._owns_connection = owns_connection
        self._wall_clock = wall_clock
        self._consumer_open = False
        self._pulling: Subscription | None = None  # the inbox of the pull request waiting
        self._bell_sub: Subscription | None = None
        self._bell = asyncio.Event()
        self._pull_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def connect(cls, url: str, namespace: str, model: str,
                      config: PrefillQueueConfig | None = None,
                      client_name: str | None = None,
                      worker: str | None = None) -> PrefillQueue:
        """Open a NATS connection the queue owns (``close()`` closes it) and ``ensure()``;
        ``worker``: the prefill worker pulling through it (its own consumers)."""
        cfg = config or PrefillQueueConfig()
        from splitserve.contracts.kit.connect import connect_nats

        nc = await connect_nats(url, name=client_name,
                                connect_timeout=max(1, int(cfg.request_timeout_s * 2)))
        queue = cls(nc, namespace, model, cfg, owns_connection=True, worker=worker)
        try:
            await queue.ensure()
        except BaseException:
            await nc.close()
            raise
        return queue

    async def ensure(self) -> None:
        """Create or update the stream and the per-level consumers to match the config."""
        c, n = self.config, self.names
        stream = api.StreamConfig(
            name=n.stream, subjects=[*n.subjects, *n.targeted],
            retention=api.RetentionPolicy.WORK_QUEUE,
            max_msgs=c.max_msgs, max_bytes=c.max_bytes, max_age=c.max_age_s,
            discard=api.DiscardPolicy.NEW, duplicate_window=c.duplicate_window_s,
            storage=api.StorageType.FILE if c.storage == "file" else api.StorageType.MEMORY,
            num_replicas=c.replicas)
        try:
            await self._js.add_stream(stream)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _ERR_STREAM_EXISTS:
                raise
            await self._js.update_stream(stream)
        for subject, durable in zip(n.subjects, n.consumers, strict=True):
            await self._js.add_consumer(n.stream, api.ConsumerConfig(
                durable_name=durable, filter_subject=subject,
                ack_policy=api.AckPolicy.EXPLICIT, ack_wait=c.ack_wait_s,
                max_deliver=c.max_deliver, deliver_policy=api.DeliverPolicy.ALL))
        if self.worker is None:
            return
        for level in range(n.levels):
            # A worker that is gone leaves its consumers behind: the server removes them
            # once nobody has pulled from them for this long (siblings drain them first).
            await self._js.add_consumer(n.stream, api.ConsumerConfig(
                durable_name=n.worker_consumer(level, self.worker),
                filter_subject=n.worker_subject(level, self.worker),
                ack_policy=api.AckPolicy.EXPLICIT, ack_wait=c.ack_wait_s,
                max_deliver=c.max_deliver, deliver_policy=api.DeliverPolicy.ALL,
                inactive_threshold=max(600.0, 2 * c.max_age_s)))

    # -- producer side -------------------------------------------------------------------

    async def enqueue(self, request: PrefillRequest, worker: str | None = None) -> Enqueued:
        """Queue one request; called by the decode worker after allocating KV blocks.
        ``worker``: queue it for that prefill worker (prefix affinity), which serves it
        before the shared jobs of its level; any idle worker takes it once it has waited
        ``steal_after_s``.

        Returns once the server stored it.  Never waits for room: raises ``QueueFull`` at
        once when the stream is at its limits, ``QueueUnavailable`` when the server does
        not answer within ``request_timeout_s``.
        """
        level = priority_level(request.priority, self.config)
        headers = {"Nats-Msg-Id": request.dedup_key()} if self.config.duplicate_window_s else None
        headers = tracing.inject(headers)  # the enqueuing span's W3C context, when tracing
        try:
            subject = (self.names.subjects[level] if worker is None
                       else self.names.worker_subject(level, worker))
            ack = await self._js.publish(subject, request.encode(),
                                         timeout=self.config.request_timeout_s,
                                         headers=headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _ERR_STORE_LIMIT:
                self.stats.rejected_full += 1
                raise QueueFull(exc.description or "stream limits reached") from exc
            self.stats.rejected_unavailable += 1
            raise QueueUnavailable(f"server refused the publish: {exc}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            self.stats.rejected_unavailable += 1
            raise QueueUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.stats.enqueued += 1
        # Wake idle prefill workers; losing this is harmless (they rescan periodically).
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(self.names.bell, b"")
        return Enqueued(stream_seq=ack.seq, level=level, duplicate=bool(ack.duplicate))

    # -- consumer side -------------------------------------------------------------------

    async def pull(self, batch: int = 1, wait_s: float = 1.0) -> list[PrefillJob]:
        """Wait up to ``wait_s`` for work; called in a prefill worker's loop.

        Returns up to ``batch`` jobs, filled from the highest non-empty level down, or an
        empty list on timeout.  Expired and unreadable deliveries are settled here
        (ack / term) and counted, never returned.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        deadline = time.monotonic() + wait_s
        async with self._pull_lock:
            await self._open_consumer_side()
            while not self._closed:
                # Clear before scanning so a bell rung during the scan is not lost.
                self._bell.clear()
                jobs = await self._scan(batch)
                if not jobs and self.worker is not None:
                    jobs = await self._steal(batch)
                remaining = deadline - time.monotonic()
                if jobs or remaining <= 0:
                    return jobs
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._bell.wait(),
                                           min(self.config.idle_recheck_s, remaining))
        return []

    async def jobs(self, batch: int = 1, poll_s: float = 1.0) -> AsyncIterator[PrefillJob]:
        """Yield jobs forever (until ``close()``), highest priority first; the worker
        loop's ``async for job in queue.jobs(): ...``."""
        while not self._closed:
            for job in await self.pull(batch, wait_s=poll_s):
                yield job

    async def _scan(self, batch: int) -> list[PrefillJob]:
        jobs: list[PrefillJob] = []
        for level, consumers in enumerate(self._scan_order):
            # Stay on a level until it is empty or the batch is full: dropped (expired or
            # unreadable) messages must not let a lower level jump ahead of this one.
            # This worker's own jobs first: they were queued here for the prefix it holds.
            for consumer in consumers:
                source = "shared" if consumer == self.names.consumers[level] else "own"
                while len(jobs) < batch:
                    msgs, answered = await self._next(consumer, batch - len(jobs))
                    for msg in msgs:
                        job = await self._admit(msg, level, source)
                        if job is not None:
                            jobs.append(job)
                    if not answered:
                        # The server did not answer in time: this level may hold work
                        # that a lower level must not overtake; the next scan asks again.
                        return jobs
                    if not msgs:
                        break
        return jobs

    async def _steal(self, batch: int) -> list[PrefillJob]:
        """Jobs other workers left unstarted for ``steal_after_s``, oldest first within
        the highest level; called when this worker's own and the shared queues are empty,
        at most every ``idle_recheck_s``.  One listing of the stream's consumers, then a
        look (without taking it) at the next job of each worker queue holding any."""
        now = time.monotonic()
        if now < self._next_steal:
            return []
        self._next_steal = now + self.config.idle_recheck_s
        names, wall = self.names, self._wall_clock()
        try:
            infos = await self._consumers()
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("listing %s's consumers failed: %s", names.stream, exc)
            return []
        stale: list[tuple[int, float, str]] = []
        for info in infos:
            owner = names.consumer_owner(info.name)
            if (owner is None or not info.num_pending
                    or info.name == names.worker_consumer(owner[0], self.worker or "")):
                continue
            waited = await self._waited(info, wall)
            if waited is not None and waited >= self.config.steal_after_s:
                stale.append((owner[0], -waited, info.name))
        jobs: list[PrefillJob] = []
        for level, _, consumer in sorted(stale):
            if len(jobs) >= batch:
                break
            msgs, _answered = await self._next(consumer, 1)
            for msg in msgs:
                job = await self._admit(msg, level, "stolen")
                if job is not None:
                    self.stats.stolen += 1
                    jobs.append(job)
        return jobs

    async def _waited(self, info, wall: float) -> float | None:
        """Seconds the next undelivered job of consumer ``info`` has been queued, read
        without taking it; None when it cannot be read (taken meanwhile, unreadable)."""
        try:
            msg = await self._js.get_msg(self.names.stream,
                                         seq=(info.delivered.stream_seq or 0) + 1,
                                         subject=info.config.filter_subject, next=True)
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("peeking at %s failed: %s", info.name, exc)
            return None
        verdict = triage(msg.data or b"", wall)
        if verdict.request is None:
            return self.config.steal_after_s  # unreadable: whoever takes it terminates it
        return wall - verdict.request.enqueued_at

    async def _next(self, consumer: str, n: int) -> tuple[list[Msg], bool]:
        """Up to ``n`` messages of ``consumer`` and whether the server answered in time.

        A no-wait pull request is answered at once: up to n messages, then a status
        ("404 No Messages") if fewer were available.  Unlike a lingering request it leaves
        nothing behind on the server that could capture a later message.  Each request
        has an inbox of its own, dropped once answered, so the late answer of an earlier
        one (the server or this process stalled past ``request_timeout_s``) is never read
        as this one's; a message of such an answer reaches nobody and is redelivered after
        ``ack_wait_s``.
        """
        sub = self._pulling = await self._nc.subscribe(self._nc.new_inbox())
        try:
            request = json.dumps({"batch": n, "no_wait": True}).encode()
            await self._nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{self.names.stream}.{consumer}", request,
                reply=sub.subject)
            msgs: list[Msg] = []
            while len(msgs) < n:
                try:
                    msg = await sub.next_msg(timeout=self.config.request_timeout_s)
                except nats.errors.TimeoutError:
                    self.stats.pull_timeouts += 1
                    log.warning("no answer to a pull request on %s %s within %.1fs",
                                self.names.stream, consumer, self.config.request_timeout_s)
                    return msgs, False
                except nats.errors.Error:
                    if self._closed:  # close() unsubscribed the inbox under this pull
                        break
                    raise
                if msg.headers and msg.headers.get("Status"):
                    break  # end of this answer (404 / 408), or an error status
                msgs.append(msg)
            return msgs, True
        finally:
            self._pulling = None
            if not self._closed:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    async def _admit(self, msg: Msg, level: int, source: str = "shared") -> PrefillJob | None:
        count = msg.metadata.num_delivered
        self.stats.delivered += 1
        if count > 1:
            self.stats.redelivered += 1
        verdict = triage(msg.data, self._wall_clock())
        if verdict.verdict == "ok" and verdict.request is not None:
            return PrefillJob(verdict.request, msg, level=level, delivery_count=count,
                              stats=self.stats, ack_timeout_s=self.config.request_timeout_s,
                              source=source)
        self.stats.dropped_by_reason[verdict.verdict] += 1
        if verdict.verdict == "expired":
            # The decode worker already prefilled locally; redelivering would waste work.
            self.stats.expired += 1
            await msg.ack()
        else:
            # Unreadable on this worker means unreadable on every worker: no redelivery.
            self.stats.malformed += 1
            self.stats.terminated += 1
            log.warning("terminating unreadable prefill request on %s: %s %s",
                        self.names.stream, verdict.verdict, verdict.detail)
            await msg.term()
        return None

    async def _open_consumer_side(self) -> None:
        if self._consumer_open:
            return
        if self._closed:
            raise RuntimeError("the prefill queue is closed")

        async def ring(_msg: Msg) -> None:
            self._bell.set()

        self._bell_sub = await self._nc.subscribe(self.names.bell, cb=ring)
        self._consumer_open = True

    # -- depth and lifecycle -------------------------------------------------------------

    async def depth(self) -> QueueDepth:
        """Exact depth from the server, every worker's own queue included (one listing of
        the stream's consumers); called by the depth monitor, tests and the CLI."""
        names = self.names
        shared = {name: level for level, name in enumerate(names.consumers)}
        waiting, in_flight = [0] * names.levels, [0] * names.levels
        by_worker: dict[str, int] = {}
        for info in await self._consumers():
            level = shared.get(info.name)
            if level is None:
                owner = names.consumer_owner(info.name)
                if owner is None:
                    continue
                level, worker = owner
                by_worker[worker] = (by_worker.get(worker, 0) + (info.num_pending or 0)
                                     + (info.num_ack_pending or 0))
            waiting[level] += info.num_pending or 0
            in_flight[level] += info.num_ack_pending or 0
        return QueueDepth(waiting=tuple(waiting), in_flight=tuple(in_flight),
                          measured_at=time.monotonic(), by_worker=by_worker)

    async def _consumers(self) -> list[api.ConsumerInfo]:
        """Every consumer of the stream (the server lists 256 per request)."""
        out: list[api.ConsumerInfo] = []
        while True:
            page = await self._js.consumers_info(self.names.stream, offset=len(out) or None)
            out += page
            if len(page) < 256:
                return out

    def depth_monitor(self) -> QueueDepthMonitor:
        """A monitor refreshing ``depth()`` every ``depth_refresh_s``; the caller starts
        and stops it."""
        return QueueDepthMonitor(self.depth, self.config.depth_refresh_s)

    async def close(self) -> None:
        """Stop pulling and drop subscriptions; closes the connection if this queue owns
        it.  Unsettled jobs are redelivered by the server after ``ack_wait_s``."""
        if self._closed:
            return
        self._closed = True
        self._bell.set()
        for sub in [*([self._pulling] if self._pulling else []),
                    *([self._bell_sub] if self._bell_sub else [])]:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._pulling, self._bell_sub = None, None
        if self._owns_connection:
            await self._nc.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
