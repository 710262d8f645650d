"""``PrefillQueue``: the NATS JetStream adapter of the prefill work queue.

Layout (see docs/prefill_queue.md): one WorkQueue stream per (namespace, model), one
subject per priority level, and one durable pull consumer per level shared by every
prefill worker.  Workers scan the levels highest first with no-wait pull requests, so a
queued high-priority request is always served before any lower one.  An idle worker
sleeps on a small "bell" subject that ``enqueue`` rings, plus a periodic rescan that
catches redeliveries.
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
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config or PrefillQueueConfig()
        self.names: QueueNames = queue_names(namespace, model, len(self.config.priorities))
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
                      client_name: str | None = None) -> PrefillQueue:
        """Open a NATS connection the queue owns (``close()`` closes it) and ``ensure()``."""
        cfg = config or PrefillQueueConfig()
        from splitserve.contracts.kit.connect import connect_nats

        nc = await connect_nats(url, name=client_name,
                                connect_timeout=max(1, int(cfg.request_timeout_s * 2)))
        queue = cls(nc, namespace, model, cfg, owns_connection=True)
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
            name=n.stream, subjects=list(n.subjects), retention=api.RetentionPolicy.WORK_QUEUE,
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

    # -- producer side -------------------------------------------------------------------

    async def enqueue(self, request: PrefillRequest) -> Enqueued:
        """Queue one request; called by the decode worker after allocating KV blocks.

        Returns once the server stored it.  Never waits for room: raises ``QueueFull`` at
        once when the stream is at its limits, ``QueueUnavailable`` when the server does
        not answer within ``request_timeout_s``.
        """
        level = priority_level(request.priority, self.config)
        headers = {"Nats-Msg-Id": request.dedup_key()} if self.config.duplicate_window_s else None
        headers = tracing.inject(headers)  # the enqueuing span's W3C context, when tracing
        try:
            ack = await self._js.publish(self.names.subjects[level], request.encode(),
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
        for level in range(self.names.levels):
            # Stay on a level until it is empty or the batch is full: dropped (expired or
            # unreadable) messages must not let a lower level jump ahead of this one.
            while len(jobs) < batch:
                msgs, answered = await self._next(level, batch - len(jobs))
                for msg in msgs:
                    job = await self._admit(msg, level)
                    if job is not None:
                        jobs.append(job)
                if not answered:
                    # The server did not answer in time: this level may hold work that a
                    # lower level must not overtake; the next scan asks again.
                    return jobs
                if not msgs:
                    break
        return jobs

    async def _next(self, level: int, n: int) -> tuple[list[Msg], bool]:
        """Up to ``n`` messages of ``level`` and whether the server answered in time.

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
                f"$JS.API.CONSUMER.MSG.NEXT.{self.names.stream}."
                f"{self.names.consumers[level]}", request, reply=sub.subject)
            msgs: list[Msg] = []
            while len(msgs) < n:
                try:
                    msg = await sub.next_msg(timeout=self.config.request_timeout_s)
                except nats.errors.TimeoutError:
                    self.stats.pull_timeouts += 1
                    log.warning("no answer to a pull request on %s level %d within %.1fs",
                                self.names.stream, level, self.config.request_timeout_s)
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

    async def _admit(self, msg: Msg, level: int) -> PrefillJob | None:
        count = msg.metadata.num_delivered
        self.stats.delivered += 1
        if count > 1:
            self.stats.redelivered += 1
        verdict = triage(msg.data, self._wall_clock())
        if verdict.verdict == "ok" and verdict.request is not None:
            return PrefillJob(verdict.request, msg, level=level, delivery_count=count,
                              stats=self.stats, ack_timeout_s=self.config.request_timeout_s)
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
        """Exact depth from the server (one consumer-info request per level, in parallel);
        called by the depth monitor, tests and the CLI."""
        infos = await asyncio.gather(*(
            self._js.consumer_info(self.names.stream, durable,
                                   timeout=self.config.request_timeout_s)
            for durable in self.names.consumers))
        return QueueDepth(waiting=tuple(i.num_pending or 0 for i in infos),
                          in_flight=tuple(i.num_ack_pending or 0 for i in infos),
                          measured_at=time.monotonic())

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
