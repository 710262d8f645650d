"""First tokens and decode progress, batched for the Router process that placed them.

A frontend routing in process reports each request's first token and, every
``PROGRESS_TOKENS`` more output tokens, its progress to its own routing service
(``inproc.InProcessBackend``): a prompt leaves the work ahead of later requests as soon as
its first token comes back, the TTFT and TPOT fits learn at once, and admission knows how
fast the answers decode now.  A Router process would otherwise learn all of that at each
request's release only, and count every prompt as work ahead until then.

``ProgressFeed`` gives a Router process the same reports: they are gathered per router
replica and sent every ``interval_s`` as one ``ProgressBatch`` to that replica's
``progress`` endpoint (one RPC per replica and interval, not one per report), each dated
by its age at sending so that the router places it on its own clock.  Nothing waits for
it: a report that cannot be sent (the replica left, is of a release without the
endpoint, or does not answer) is dropped and counted; the release still tells the router
everything at the end.  The pending reports are bounded (``max_pending``; the oldest go
first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter

from splitserve.contracts.metrics import PREFIX
from splitserve.contracts.wire import PROGRESS_BATCH_MAX, ProgressBatch, ProgressReport

log = logging.getLogger(__name__)

PROGRESS_TOKENS = 16
"""A request's progress is reported each time this many more output tokens streamed."""


def due_reports(before: int, tokens: int, due: int) -> tuple[bool, bool, bool, int]:
    """What a stream that had ``before`` output tokens and now has ``tokens`` reports,
    ``due`` being the count at which its next progress report is due: (first token,
    progress, wake: the report teaches a fit, the next ``due``)."""
    first = before == 0
    progress = tokens >= due
    wake = progress and due == PROGRESS_TOKENS
    while due <= tokens:
        due += PROGRESS_TOKENS
    return first, progress, wake, due


class ProgressMetrics:
    """The feed's reports, by what became of them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.reports = Counter(
            f"{PREFIX}_frontend_progress_reports_total",
            "First-token and decode-progress reports for the Router process, by outcome: "
            "sent, unsupported (the replica serves no progress endpoint: an earlier "
            "release, or it left), failed (the RPC failed) or overflow (dropped, more "
            "were pending than the feed keeps)", ["outcome"], registry=r)


class ProgressFeed:
    """Gathers reports per router replica and sends them in batches (see the module
    docstring).  ``client``: a Dynamo client of the routers' ``progress`` endpoint."""

    def __init__(self, client, interval_s: float = 0.025, max_pending: int = 10_000,
                 timeout_s: float = 2.0, metrics: ProgressMetrics | None = None,
                 clock=time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self.metrics = metrics or ProgressMetrics()
        # router id -> (request id, worker id, tokens, seen at, first, progress, wake)
        self._pending: dict[int, deque[tuple]] = {}
        self._count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending: dict[int, asyncio.Task] = {}

    def report(self, router_id: int | None, request_id: str, worker_id: int | None,
               tokens: int, first: bool, progress: bool, wake: bool) -> None:
        """Queue one report for ``router_id`` (the replica that placed the request)."""
        if router_id is None or not worker_id or tokens < 1:
            return
        queue = self._pending.setdefault(router_id, deque())
        queue.append((request_id, worker_id, tokens, self.clock(), first, progress, wake))
        self._count += 1
        if self._count > self.max_pending:
            self._drop_oldest()
        self._arm()

    def _arm(self) -> None:
        """Flush in ``interval_s`` unless a flush is due already."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s,
                                                                self._flush)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _drop_oldest(self) -> None:
        longest = max(self._pending.values(), key=len)
        longest.popleft()
        self._count -= 1
        self.metrics.reports.labels("overflow").inc()

    def _flush(self) -> None:
        self._timer = None
        for router_id in list(self._pending):
            if router_id in self._sending:
                continue  # its previous batch is still on the way: the next tick sends
            queue = self._pending[router_id]
            if not queue:
                del self._pending[router_id]
                continue
            n = min(len(queue), PROGRESS_BATCH_MAX)
            items = [queue.popleft() for _ in range(n)]
            self._count -= n
            if not queue:
                del self._pending[router_id]
            task = asyncio.ensure_future(self._send(router_id, items))
            self._sending[router_id] = task
            task.add_done_callback(lambda _t, r=router_id: self._sent(r))
        if self._pending:
            self._arm()

    def _sent(self, router_id: int) -> None:
        self._sending.pop(router_id, None)
        if self._pending.get(router_id):
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self._arm()

    async def _send(self, router_id: int, items: list[tuple]) -> None:
        if router_id not in self.client.instance_ids():
            self.metrics.reports.labels("unsupported").inc(len(items))
            return
        now = self.clock()
        batch = ProgressBatch(reports=[
            ProgressReport(request_id=rid, worker_id=wid, tokens=tokens,
                           age_s=min(3600.0, max(0.0, now - seen)), first_token=first,
                           progress=progress, wake=wake)
            for rid, wid, tokens, seen, first, progress, wake in items])
        try:
            async with asyncio.timeout(self.timeout_s):
                stream = await self.client.direct(batch.model_dump(mode="json"), router_id)
                async for _ in stream:
                    pass
        except Exception as exc:  # noqa: BLE001 - the release tells the router anyway
            self.metrics.reports.labels("failed").inc(len(items))
            log.debug("progress reports for router %x failed: %s", router_id, exc)
            return
        self.metrics.reports.labels("sent").inc(len(items))

    async def close(self) -> None:
        """Send what is pending and wait (bounded) for the batches on their way."""
        self._disarm()
        self._flush()
        self._disarm()  # what waits behind a batch still on its way is not sent
        if self._sending:
            await asyncio.wait(list(self._sending.values()), timeout=self.timeout_s)
