"""``PrefillJob``: one delivered prefill request and the calls that settle it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from splitserve.contracts.prefill_job import PrefillRequest
from .stats import PrefillQueueStats


class JetStreamMessage(Protocol):
    """The acknowledgement calls of a delivered JetStream message (nats-py's ``Msg``)."""

    async def ack_sync(self, timeout: float = 1.0) -> object: ...  # noqa: ASYNC109 - nats-py's
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...
    async def term(self) -> None: ...


class PrefillJob:
    """A prefill request handed to a prefill worker by ``PrefillQueue.pull``/``jobs``.

    The worker must end every job with exactly one of ``ack`` (KV written into the decode
    worker's blocks and the decode worker notified), ``nak`` (could not do it now; let
    another worker retry) or ``term`` (can never succeed).  During a prefill that may
    outlast ``ack_wait_s`` it calls ``in_progress`` to push the redelivery deadline back.
    """

    def __init__(self, request: PrefillRequest, msg: JetStreamMessage, *, level: int,
                 delivery_count: int, stats: PrefillQueueStats, ack_timeout_s: float,
                 source: str = "shared") -> None:
        self.request = request
        self.level = level
        self.source = source
        """The queue it came from: ``shared``, ``own`` (queued for this worker: prefix
        affinity) or ``stolen`` (queued for another worker, left waiting there)."""
        self.delivery_count = delivery_count
        self._msg = msg
        self._stats = stats
        self._ack_timeout_s = ack_timeout_s
        self.settled = False

    @property
    def headers(self) -> Mapping[str, str] | None:
        """The message's JetStream headers: the enqueuing decode worker's W3C trace
        context when tracing is on (``traceparent``; ``contracts.tracing``)."""
        return getattr(self._msg, "headers", None)

    def __repr__(self) -> str:
        return (f"PrefillJob(request_id={self.request.request_id!r}, level={self.level}, "
                f"delivery_count={self.delivery_count})")

    async def ack(self) -> None:
        """Call after the KV transfer completed.  Waits for the server to confirm, so a
        return means the request will not be redelivered; raises on timeout."""
        await self._msg.ack_sync(timeout=self._ack_timeout_s)
        self.settled = True
        self._stats.acked += 1

    async def nak(self, delay_s: float | None = None) -> None:
        """Call when this worker cannot serve the request (e.g. shutting down); it is
        redelivered after ``delay_s`` (now when None), up to ``max_deliver`` deliveries."""
        await self._msg.nak(delay=delay_s)
        self.settled = True
        self._stats.naked += 1

    async def in_progress(self) -> None:
        """Call periodically (well inside ``ack_wait_s``) during a long prefill; restarts
        the server's redelivery timer for this delivery."""
        await self._msg.in_progress()

    async def term(self, reason: str = "terminated") -> None:
        """Call when the request can never succeed (e.g. the decode worker is gone); the
        server drops it without redelivery.  ``reason`` is counted."""
        await self._msg.term()
        self.settled = True
        self._stats.terminated += 1
        self._stats.dropped_by_reason[reason] += 1
