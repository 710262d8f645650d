"""Placements shared between frontend processes that route in process.

With ``Frontend.routing: in_process`` every frontend process places and admits its own
requests.  Several processes on one port (``Frontend.replicas``) would each see only
their own placements: the prompts a sibling queued on a worker, its answers decoding
there, its first tokens.  Admission would predict each worker's queue at a fraction of
its length and place as if the fleet were emptier than it is.

``PlacementShare`` tells the siblings what this process's routing service does and
applies what they tell it, so every process follows every request placed by any of
them:

- ``place``: the request, its worker, its prompt's block hashes (the recent-prefix
  tracker) and what admission follows it with (its estimate, class and budget);
- ``first``: its first token came back (its prompt leaves the queue ahead);
- ``progress``: it has streamed so many output tokens (the answers' pace);
- ``release``: it is over, with the timings the fits learn from.

A sibling's request is followed exactly as one's own (``RouterService.adopt`` and
friends) except that it is never counted in this process's verdicts, confusion table or
prediction error: those stay each process's own.  Messages travel over core NATS, one
subject per routed pool, batched every ``interval_s``; each process's connection does
not hear its own.  Nothing is sent while no sibling has been heard from: a process
alone only says it is there (``heartbeat_s``).  A new sibling (a replica started,
restarted or scaled up) is sent every request in flight here at once, so it follows
them from its first second; a sibling not heard from for ``timeout_s`` (killed), or
that says it stops, has its requests dropped at once instead of pinning load until the
placements' TTL.  Core NATS can lose a message: each heartbeat lists the requests its
sender has in flight, and a receiver drops any of that sender's it still follows that
are not listed, so a lost release costs at most a second of phantom load.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.contracts.metrics import PREFIX
from splitserve.contracts.wire import ReleaseCall

log = logging.getLogger("splitserve.router.share")

SHARE_VERSION = 1
INTERVAL_S = 0.005
HEARTBEAT_S = 1.0
TIMEOUT_S = 3.5
MAX_PENDING = 50_000
"""Events kept unsent at most (the oldest go first, counted as overflow)."""
MAX_MESSAGE_BYTES = 256 * 1024
"""One message at most (NATS refuses what is over its max_payload, 1 MiB by default)."""

PLACE, FIRST, PROGRESS, RELEASE = "place", "first", "progress", "release"


def share_subject(namespace: str, component: str) -> str:
    """The subject the frontend processes routing to ``component`` share placements on."""
    return f"splitserve.{namespace}.{component.lower()}.placements"


class ShareMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.events = Counter(
            f"{PREFIX}_router_shared_events_total",
            "Placement events shared with the other frontend processes routing in process "
            "(direction sent or applied; skipped: for a request not followed here, "
            "overflow: dropped unsent), by kind: place, first, progress, release",
            ["direction", "kind"], registry=r)
        self.siblings = Gauge(f"{PREFIX}_router_siblings",
                              "Other processes routing to the same workers heard from",
                              registry=r)
        self.dropped = Counter(
            f"{PREFIX}_router_sibling_requests_dropped_total",
            "Requests of a sibling dropped from this process's accounting: the sibling "
            "stopped or went silent, or its heartbeat no longer lists them (a release "
            "lost on the way)", registry=r)


class PlacementShare:
    """One process's side of the sharing (see the module docstring).

    ``publish(payload)``: sends one message to every sibling (not to this process).
    ``service``: the ``RouterService`` whose placements are shared and which follows
    the siblings' (``adopt``, ``adopt_first``, ``adopt_progress``, ``adopt_release``,
    ``drop_foreign``).
    """

    def __init__(self, service, publish: Callable[[bytes], Awaitable[None]], *,
                 origin: str | None = None, interval_s: float = INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S, timeout_s: float = TIMEOUT_S,
                 metrics: ShareMetrics | None = None, clock=time.monotonic,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.service = service
        self.publish = publish
        self.origin = origin or uuid.uuid4().hex
        self.interval_s, self.heartbeat_s, self.timeout_s = interval_s, heartbeat_s, timeout_s
        self.max_bytes = max_bytes
        self.metrics = metrics or ShareMetrics()
        self.clock = clock
        self.siblings: dict[str, float] = {}
        """Origin -> when it was last heard from."""
        self.foreign: dict[str, set[str]] = {}
        """Origin -> the requests of it followed here."""
        self.own: dict[str, list] = {}
        """This process's requests in flight: their place event, as a new sibling is sent."""
        self.pending: list[list] = []
        self._wake = asyncio.Event()
        self._last_beat = float("-inf")
        self._announce = True  # say hello at once (a sibling sends its requests back)

    # -- what this process does ---------------------------------------------------------

    def placed(self, request_id: str, worker_id: int, hashes: list[int],
               estimate: Any, ticket: dict | None) -> None:
        """This process placed ``request_id`` on ``worker_id``; ``estimate`` and
        ``ticket`` what its predictor follows it with (None: nothing).  The estimate is
        turned into its wire form only when the event is sent (``_outgoing``): a process
        alone keeps the event for a sibling that may start, and does no more."""
        event = [PLACE, request_id, worker_id, hashes,
                 None if ticket is None else estimate, ticket, False]
        self.own[request_id] = event
        self._send(event)

    def first_token(self, request_id: str) -> None:
        event = self.own.get(request_id)
        if event is not None:
            event[6] = True
            self._send([FIRST, request_id, event[2]])

    def progress(self, request_id: str, tokens: int) -> None:
        event = self.own.get(request_id)
        if event is not None:
            self._send([PROGRESS, request_id, event[2], tokens])

    def released(self, call: ReleaseCall) -> None:
        event = self.own.get(call.request_id)
        if event is None or event[2] != call.worker_id:  # placed again elsewhere since
            return
        del self.own[call.request_id]
        self._send([RELEASE, call.request_id, call.worker_id, call.outcome, call.ttft_s,
                    call.duration_s, call.output_tokens])

    @staticmethod
    def _outgoing(event: list) -> list:
        """``event`` ready to encode: a place event's estimate in its wire form (once:
        the event is kept, and sent again to a sibling that starts)."""
        if event[0] == PLACE and event[4] is not None and not isinstance(event[4], dict):
            event[4] = event[4].model_dump(mode="json")
        return event

    def _send(self, event: list) -> None:
        if not self.siblings:
            return
        self.pending.append(self._outgoing(event))
        if len(self.pending) > MAX_PENDING:
            dropped = self.pending[:len(self.pending) - MAX_PENDING]
            del self.pending[:len(dropped)]
            for e in dropped:
                self.metrics.events.labels("overflow", e[0]).inc()
        self._wake.set()

    # -- what the siblings say ----------------------------------------------------------

    def receive(self, payload: bytes) -> int:
        """Apply one message from a sibling; returns the events applied."""
        try:
            msg = msgspec.msgpack.decode(payload)
            origin = msg["o"]
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            log.debug("unreadable placement message: %s", exc)
            return 0
        if origin == self.origin or msg.get("v") != SHARE_VERSION:
            return 0
        if msg.get("bye"):
            self._forget(origin)
            return 0
        now = self.clock()
        if origin not in self.siblings:
            log.info("frontend process %s routes beside this one: sharing placements "
                     "(%d in flight here sent to it)", origin[:8], len(self.own))
            self.siblings[origin] = now
            self.metrics.siblings.set(len(self.siblings))
            self.pending.extend(map(self._outgoing, self.own.values()))  # it follows ours
            self._announce = True  # and hears from this one at once, even with none
            self._wake.set()
        self.siblings[origin] = now
        mine = self.foreign.setdefault(origin, set())
        applied = 0
        for event in msg.get("e", ()):
            try:
                ok = self._apply(event, mine, now)
            except (IndexError, KeyError, TypeError, ValueError) as exc:
                log.debug("unreadable placement event %r: %s", event, exc)
                continue
            if ok is None:
                continue
            self.metrics.events.labels("applied" if ok else "skipped", event[0]).inc()
            applied += ok
        live = msg.get("live")
        if live is not None:  # what it still has in flight: the rest was released
            gone = mine.difference(live)
            if gone:
                mine.difference_update(gone)
                dropped = self.service.drop_foreign(gone, now)
                if dropped:
                    self.metrics.dropped.inc(dropped)
                    log.info("%d requests of frontend process %s released unseen: dropped",
                             dropped, origin[:8])
        return applied

    def _apply(self, event: list, mine: set[str], now: float) -> bool | None:
        """Apply one sibling event; True if it changed anything, None for an unknown kind."""
        service = self.service
        kind, rid, wid = event[0], event[1], event[2]
        if kind == PLACE:
            ok = service.adopt(rid, wid, event[3], event[4], event[5], now)
            if ok:
                mine.add(rid)
                if event[6]:
                    service.adopt_first(rid, wid, now)
            return ok
        if kind == FIRST:
            return service.adopt_first(rid, wid, now)
        if kind == PROGRESS:
            return service.adopt_progress(rid, wid, int(event[3]), now)
        if kind == RELEASE:
            ok = rid in mine and service.adopt_release(ReleaseCall(
                request_id=rid, worker_id=wid, outcome=event[3], ttft_s=event[4],
                duration_s=event[5], output_tokens=event[6]), now)
            mine.discard(rid)
            return ok
        return None

    def _forget(self, origin: str) -> None:
        """``origin`` stopped or went silent: drop its requests from the accounting."""
        self.siblings.pop(origin, None)
        self.metrics.siblings.set(len(self.siblings))
        rids = self.foreign.pop(origin, set())
        dropped = self.service.drop_foreign(rids, self.clock())
        if dropped:
            self.metrics.dropped.inc(dropped)
        log.info("frontend process %s is gone: %d of its requests dropped", origin[:8],
                 dropped)

    # -- the loop -----------------------------------------------------------------------

    def _envelope(self, events: list, **flags) -> bytes:
        return msgspec.msgpack.encode({"v": SHARE_VERSION, "o": self.origin, "e": events,
                                       **flags})

    async def tick(self) -> None:
        """Send what is pending, a heartbeat when due, and forget silent siblings.

        A heartbeat sent while siblings are heard carries this process's requests in
        flight (``live``): a sibling drops any of this one's requests it still follows
        that are not among them (a release lost on the way).  Messages stay under
        ``max_bytes`` (NATS refuses larger ones): a large batch, such as every request
        in flight sent to a sibling that started, goes as several.  What could not be
        sent is kept for the next tick."""
        now = self.clock()
        for origin in [o for o, at in self.siblings.items() if now - at > self.timeout_s]:
            self._forget(origin)
        events, self.pending = self.pending, []
        beat = self._announce or now - self._last_beat >= self.heartbeat_s
        if not events and not beat:
            return
        flags = {"live": list(self.own)} if beat and self.siblings else {}
        sent = 0
        try:
            for payload, n in self._messages(events, flags):
                await self.publish(payload)
                for e in events[sent:sent + n]:
                    self.metrics.events.labels("sent", e[0]).inc()
                sent += n
        except BaseException:
            self.pending[:0] = events[sent:]  # in order, before what came since
            raise
        if beat:
            self._announce = False
            self._last_beat = now

    def _messages(self, events: list, flags: dict):
        """(payload, events in it) for ``events`` in order, each under ``max_bytes``;
        ``flags`` go with the last."""
        payload = self._envelope(events, **flags)
        if len(payload) <= self.max_bytes or len(events) <= 1:
            yield payload, len(events)
            return
        half = len(events) // 2
        yield from self._messages(events[:half], {})
        yield from self._messages(events[half:], flags)

    async def run(self, stopping: asyncio.Event) -> None:
        """Send batches every ``interval_s`` while anything is pending, heartbeats every
        ``heartbeat_s``, until ``stopping``; then tell the siblings this one stops."""
        async def wake_on_stop() -> None:
            await stopping.wait()
            self._wake.set()

        watcher = asyncio.ensure_future(wake_on_stop())
        try:
            while not stopping.is_set():
                self._wake.clear()
                try:
                    await self.tick()
                except Exception as exc:  # noqa: BLE001 - NATS reconnecting: next tick
                    log.debug("sharing placements failed: %s", exc)
                try:
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
                except TimeoutError:
                    continue
                if not stopping.is_set():
                    await asyncio.sleep(self.interval_s)  # gather a batch
        finally:
            watcher.cancel()
        try:
            await self.publish(self._envelope([], bye=True))
        except Exception as exc:  # noqa: BLE001 - stopping anyway
            log.debug("could not say goodbye: %s", exc)


async def start_sharing(nats_url: str, subject: str, service, stopping: asyncio.Event
                        ) -> tuple[PlacementShare, asyncio.Task]:
    """Connect to NATS, follow ``subject`` and start sharing ``service``'s placements;
    returns the share and its task (done once ``stopping`` is set and NATS is closed)."""
    from splitserve.contracts.kit.connect import close_nats, connect_nats

    nc = await connect_nats(nats_url, name="splitserve-placements", no_echo=True,
                            max_reconnect_attempts=-1)

    async def publish(payload: bytes) -> None:
        await nc.publish(subject, payload)

    share = PlacementShare(service, publish, metrics=ShareMetrics(service.metrics.registry))

    async def on_msg(msg) -> None:
        share.receive(msg.data)

    await nc.subscribe(subject, cb=on_msg)
    service.share = share

    async def run() -> None:
        try:
            await share.run(stopping)
        finally:
            service.share = None
            await close_nats(nc, "placement sharing")

    return share, asyncio.create_task(run())
