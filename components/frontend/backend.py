"""How the frontend reaches workers: straight to a worker pool, or through the router.

``Backend.stream(call, meta)`` sends a ``request.WorkerCall`` and yields the worker's
output chunks as dicts.  With a
Router in the graph, the frontend asks the router for a worker (one small RPC), streams
from that worker directly (tokens never pass through the router), and tells the router
when the request is over so it can account load and latency.  With
``Frontend.routing: in_process`` the same service runs in the frontend's own process
(``inproc.InProcessBackend``, which reuses this module's streaming and retries).

A worker that cannot be reached, or whose stream breaks, is taken out of the candidates
at once (discovery keeps a dead worker for seconds, until its lease expires), and the
request moves to another worker, at most ``migration_limit`` times (Dynamo's
``--migration-limit``).  A request that already streamed tokens is resumed, not resent:
the next worker gets the prompt plus the tokens the client already has, with
``max_tokens`` (and ``min_tokens``) reduced by as many, so the client's stream continues
with the next token and greedy output equals an uninterrupted run.

Readiness is truthful: with a router, ``ready()`` is true only while the router's last
status names a worker it would route to and this frontend's discovery knows it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol


from splitserve.contracts import tracing
from splitserve.contracts.kit.deadline import MovingDeadline
from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.wire import (
    DRAINED,
    KV_PARKED,
    ReleaseCall,
    RouteCall,
    RouteReply,
    RouterStatus,
    chunk_data,
    output_chunk,
)

from .errors import APIError, overloaded, upstream_error
from .migration import BackendMetrics, Resumable, WorkerUnreachable, final_chunk, migrate
from .progress import PROGRESS_TOKENS, ProgressFeed, due_reports
from .request import WorkerCall

log = logging.getLogger(__name__)

LORA_NOT_LOADED = "lora-not-loaded"
"""The router's reason for a request whose adapter no worker reports loaded."""


@dataclass
class StreamMeta:
    """Per-request facts the backend reports back (to the router, to metrics)."""

    request_id: str
    priority: str | None
    worker_id: int | None = None
    user: str | None = None
    metadata: dict | None = None
    class_name: str = "default"
    first_token_at: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    route_reason: str = ""
    predicted_ttft_ms: float | None = None
    """Admission's prediction of this request's TTFT when it was placed (None: none was
    made); answered in ``x-splitserve-predicted-ttft-ms``."""
    router_id: int | None = None
    """Instance id of the router replica that placed the request: its release goes there."""
    trace: Any = tracing.NOOP
    """The span the backend's calls continue (``contracts.tracing``; NOOP when off)."""
    received_at: float | None = None
    """``time.monotonic()`` when the frontend began handling the request: the time until
    its placement is part of its TTFT (``RouteCall.waited_ms``)."""

    def waited_ms(self) -> float:
        """Milliseconds since the frontend began handling the request (0 if unknown)."""
        if self.received_at is None:
            return 0.0
        return max(0.0, (time.monotonic() - self.received_at) * 1000.0)


async def silent_after_first(stream, stall_s: float, worker_id: int) -> AsyncIterator:
    """``stream``'s items; after the first, each within ``stall_s`` seconds (0: no
    limit), else WorkerUnreachable (``stalled``, output produced)."""
    items = aiter(stream)
    first = True
    deadline = MovingDeadline()  # one timer per stream, not one per chunk
    try:
        while True:
            try:
                if first or not stall_s:
                    item = await anext(items)
                else:
                    item = await deadline.within(anext(items), stall_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise WorkerUnreachable(worker_id, f"its stream was silent for {stall_s:g}s",
                                        produced=True, stalled=True) from None
            first = False
            yield item
    finally:
        deadline.close()


async def stream_from_worker(client, call: WorkerCall, worker_id: int, context,
                             meta_out: dict, stall_s: float = 0.0) -> AsyncIterator[dict]:
    """Chunks of ``call`` served by ``worker_id``; raises WorkerUnreachable when the
    connection fails, the stream breaks, ends before any output, or (``stall_s`` > 0)
    stays silent for ``stall_s`` seconds after its first chunk: a worker whose host was
    cut off from the network sends no reset, and its stream would otherwise hang until
    the inter-token deadline fails the request.

    Sets ``meta_out["finished"]`` once a final chunk (finish reason, no error) passed.
    """
    try:
        stream = await client.direct(call.to_wire(), worker_id, context=context)
    except Exception as exc:  # noqa: BLE001 - connection refused, instance gone, ...
        raise WorkerUnreachable(worker_id, exc) from None
    produced = drained = False
    kv = None
    try:
        async with contextlib.aclosing(silent_after_first(stream, stall_s, worker_id)) as items:
            async for item in items:
                chunk = chunk_data(item)
                if chunk.get(DRAINED):
                    drained = True
                    kv = chunk.get(KV_PARKED)
                    if chunk.get("token_ids"):  # made by the engine, not sent before the cut
                        produced = True
                        yield output_chunk(list(chunk["token_ids"]))
                    break
                # The consumer may close us right after the last chunk: remember that the
                # request finished so the release reports it as ok, not cancelled.
                meta_out["finished"] = bool(chunk.get("finish_reason")) and not chunk.get("error")
                meta_out["errored"] = bool(chunk.get("error"))
                produced = True
                yield chunk
    except WorkerUnreachable:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream broke (worker died)
        raise WorkerUnreachable(worker_id, exc, produced) from None
    if drained:
        raise WorkerUnreachable(worker_id, "its drain ended before the request", produced,
                                drained=True,
                                kv_source={"worker_id": worker_id, **kv} if kv else None)
    if not produced:
        raise WorkerUnreachable(worker_id, "stream ended before any output")
    if not meta_out.get("finished") and not meta_out.get("errored"):
        raise WorkerUnreachable(worker_id, "stream ended before a finish reason", True)


class Backend(Protocol):
    def ready(self) -> bool: ...

    def worker_ids(self) -> list[int]:
        """The workers a request could be sent to now (instance ids)."""
        ...

    def stream(self, call: WorkerCall, meta: StreamMeta, context
               ) -> AsyncIterator[dict]: ...


class DirectBackend:
    """Frontend → Worker without a router: round-robin over the worker instances that are
    not marked down (a failed connection marks one down until it leaves discovery or
    ``down_ttl_s`` passed).  A request for a LoRA adapter goes only to the workers that
    ``adapter_workers(name)`` says have it loaded."""

    def __init__(self, worker_client, migration_limit: int = 1, down_ttl_s: float = 30.0,
                 metrics: BackendMetrics | None = None,
                 adapter_workers: Callable[[str], set[int]] | None = None,
                 stall_s: float = 0.0) -> None:
        self.client = worker_client
        self.migration_limit = migration_limit
        self.stall_s = stall_s
        self.down_ttl_s = down_ttl_s
        self.metrics = metrics or BackendMetrics()
        self.adapter_workers = adapter_workers or (lambda name: set())
        self.down: dict[int, float] = {}
        self._next = 0

    def candidates(self) -> list[int]:
        """Instances in discovery that did not fail recently."""
        now = time.monotonic()
        live = sorted(self.client.instance_ids())
        self.down = {w: t for w, t in self.down.items()
                     if w in live and now - t <= self.down_ttl_s}
        return [w for w in live if w not in self.down]

    def ready(self) -> bool:
        return bool(self.candidates())

    def worker_ids(self) -> list[int]:
        return self.candidates()

    async def stream(self, call: WorkerCall, meta: StreamMeta, context
                     ) -> AsyncIterator[dict]:
        attempt = 0
        resume = Resumable(call)
        while True:
            workers = self.candidates()
            if call.lora is not None:
                holders = self.adapter_workers(call.lora)
                workers = [w for w in workers if w in holders]
                if not workers and not attempt:
                    raise overloaded(f"no worker has the LoRA adapter '{call.lora}' loaded "
                                     "now", retry_after_s=2, code="lora_not_loaded")
            if not workers:
                if attempt:
                    raise upstream_error("the worker failed and no other worker is "
                                         "available", 502 if resume.mid_stream else 503,
                                         "no_workers")
                raise overloaded("no worker is available yet", retry_after_s=2,
                                 code="no_workers")
            wid = workers[self._next % len(workers)]
            self._next += 1
            meta.worker_id = wid
            try:
                async for chunk in stream_from_worker(self.client, call, wid, context, {},
                                                      self.stall_s):
                    resume.seen(chunk)
                    yield chunk
                return
            except WorkerUnreachable as exc:
                self.down[wid] = time.monotonic()
                moved = migrate(exc, resume, call, attempt, self.migration_limit,
                                self.metrics)
                if moved is None:
                    if resume.mid_stream and resume.left() <= 0:
                        yield final_chunk()
                        return
                    raise upstream_error(str(exc), 502 if resume.mid_stream else 503) from None
                call = moved
                attempt += 1


class RoutedBackend:
    """Frontend → Router (choose) → Worker (stream) → Router (release).

    Worker clients are opened per endpoint the router names (``connect(path)``), so the
    frontend needs no knowledge of which component the router routes to.  ``watch``
    polls the router's status (the workers it would route to) for ``ready``.

    With several router replicas each keeps its own in-flight accounting, so the frontend
    picks the replica itself (round robin over discovery) and sends the release to the
    one that placed the request, by instance id; a round-robin release would leave the
    load on the placing replica and subtract it from another.
    """

    def __init__(self, router_client, connect, route_timeout_s: float = 5.0,
                 migration_limit: int = 1, status_client=None,
                 metrics: BackendMetrics | None = None,
                 status_interval_s: float = 0.25, stall_s: float = 0.0) -> None:
        self.router = router_client
        self.stall_s = stall_s
        self.release_client = None
        self.progress_feed: ProgressFeed | None = None
        self.status_client = status_client
        self.connect = connect
        self.clients: dict[str, Any] = {}
        self.route_timeout_s = route_timeout_s
        self.migration_limit = migration_limit
        self.metrics = metrics or BackendMetrics()
        self.status_interval_s = status_interval_s
        self.status: RouterStatus | None = None
        self.status_at = 0.0
        self._release_tasks: set[asyncio.Task] = set()
        self._next_router = 0

    def pick_router(self) -> int:
        """The router replica for the next route call: round robin over discovery.

        Called once per route call; raises IndexError when discovery lists none."""
        ids = self.router.instance_ids()
        self._next_router += 1
        return ids[self._next_router % len(ids)]

    def worker_ids(self) -> list[int]:
        """The workers the router's last status would route to."""
        return list(self.status.workers) if self.status is not None else []

    def ready(self) -> bool:
        """True while a request would be served now: the router's recent status names a
        worker it would route to, and this process's discovery knows that worker."""
        st = self.status
        if (st is None or not self.router.instance_ids()
                or time.monotonic() - self.status_at > max(2.0, 4 * self.status_interval_s)):
            return False
        client = self.clients.get(st.endpoint)
        known = set(client.instance_ids()) if client is not None else set()
        return any(w in known for w in st.workers)

    async def refresh_status(self) -> RouterStatus | None:
        """Ask the router which workers it would route to; called by ``watch``."""
        try:
            stream = await asyncio.wait_for(self.status_client.round_robin({}),
                                            self.route_timeout_s)
            async for item in stream:
                st = RouterStatus.model_validate(chunk_data(item))
                if st.endpoint and st.endpoint not in self.clients:
                    self.clients[st.endpoint] = await self.connect(st.endpoint)
                self.status, self.status_at = st, time.monotonic()
                return st
        except Exception as exc:  # noqa: BLE001 - not ready until the router answers
            log.debug("router status failed: %s", exc)
        self.status = None
        return None

    async def watch(self, stopping: asyncio.Event) -> None:
        """Keep ``status`` fresh until ``stopping`` is set (a task of the frontend)."""
        while not stopping.is_set():
            if self.router.instance_ids():
                await self.refresh_status()
            else:
                self.status = None
            try:
                await asyncio.wait_for(stopping.wait(), self.status_interval_s)
            except TimeoutError:
                pass

    async def worker_client(self, endpoint: str, instance_id: int, wait_s: float = 3.0):
        """The client for ``endpoint``, once its discovery knows ``instance_id``.

        The router may name a worker this process's discovery has not seen yet (a fresh
        client, or a replica that just registered); waiting briefly avoids failing
        such a request with "instance unavailable"."""
        client = self.clients.get(endpoint)
        if client is None:
            client = self.clients[endpoint] = await self.connect(endpoint)
        await poll_until(lambda: instance_id in client.instance_ids(), wait_s, poll_s=0.02)
        return client

    async def route(self, call: RouteCall, router_id: int, trace=tracing.NOOP) -> RouteReply:
        """One RPC to router replica ``router_id``; the reply names a worker or says why
        none.  ``trace``: the span the router's spans continue."""
        async def _call() -> RouteReply:
            stream = await self.router.direct(call.model_dump(mode="json"), router_id,
                                              context=tracing.dynamo_context(trace))
            async for item in stream:
                return RouteReply.model_validate(chunk_data(item))
            raise upstream_error("router returned no decision")
        try:
            return await asyncio.wait_for(_call(), self.route_timeout_s)
        except APIError:
            raise
        except TimeoutError:
            raise upstream_error("router did not answer in time", 503, "router_timeout") from None
        except Exception as exc:  # noqa: BLE001
            raise upstream_error(f"router unavailable: {exc}", 503, "router_unavailable") from None

    async def place(self, call: RouteCall, meta: StreamMeta) -> RouteReply:
        """Have a router replica (round robin) place ``call``; ``meta.router_id`` records
        which one, so the release goes back to it.  Called once per attempt."""
        if not self.router.instance_ids():
            raise overloaded("the router is not available yet", retry_after_s=2,
                             code="no_router")
        try:
            meta.router_id = self.pick_router()
        except IndexError:
            raise overloaded("the router is not available yet", retry_after_s=2,
                             code="no_router") from None
        return await self.route(call, meta.router_id, meta.trace)

    async def stream(self, call: WorkerCall, meta: StreamMeta, context
                     ) -> AsyncIterator[dict]:
        failed: list[int] = []
        resume = Resumable(call)
        while True:
            reply = await self.place(RouteCall(
                request_id=meta.request_id, token_ids=list(call.token_ids),
                priority=meta.priority, user=meta.user, metadata=meta.metadata,
                max_tokens=resume.left(), failed_workers=failed, lora=call.lora,
                waited_ms=meta.waited_ms()), meta)
            self._check_reply(reply, failed, call.lora, call.model)
            self._note_reply(reply, meta)
            placed_call = call.placed(reply, resume.left())
            try:
                # aclosing: if our consumer stops early, the placement is released now
                # (as ok or cancelled), not whenever the inner generator is collected.
                async with contextlib.aclosing(
                        self._stream_placed(placed_call, reply, meta, context)) as placed:
                    async for chunk in placed:
                        resume.seen(chunk)
                        yield chunk
                return
            except WorkerUnreachable as exc:
                moved = migrate(exc, resume, call, len(failed), self.migration_limit,
                                self.metrics)
                if moved is None:
                    if resume.mid_stream and resume.left() <= 0:
                        yield final_chunk()
                        return
                    raise upstream_error(str(exc), 502 if resume.mid_stream else 503) from None
                call = moved
                failed.append(reply.worker_id)

    def _check_reply(self, reply: RouteReply, failed: list[int],
                     lora: str | None = None, model: str = "") -> None:
        """Raise the HTTP error for a rejection or for no worker at all (naming the model:
        a graph may serve several)."""
        if reply.retry_after_s is not None:
            est = (reply.qos or {}).get("est_ttft_ms")
            detail = f" (estimated time to first token {est:.0f} ms)" if est else ""
            raise overloaded(f"request rejected early for priority class "
                             f"'{reply.class_name}': {reply.reason}{detail}; retry later",
                             retry_after_s=reply.retry_after_s, code=reply.reason)
        if reply.worker_id is None and reply.reason == LORA_NOT_LOADED:
            raise overloaded(f"no worker has the LoRA adapter '{lora}' loaded now",
                             retry_after_s=2, code="lora_not_loaded")
        if reply.worker_id is None:
            of = f" of {model}" if model else ""
            what = f"no other worker{of} can take the request after worker " + \
                ", ".join(f"{w:x}" for w in failed) + " failed" if failed else \
                f"no worker{of} can take the request"
            raise overloaded(f"{what} ({reply.reason})", retry_after_s=2, code=reply.reason)

    @staticmethod
    def _note_reply(reply: RouteReply, meta: StreamMeta) -> None:
        """What the placement tells the accounting (the call itself: ``placed``)."""
        meta.route_reason = reply.reason
        meta.predicted_ttft_ms = (reply.qos or {}).get("est_ttft_ms")
        meta.class_name = reply.class_name
        meta.worker_id = reply.worker_id

    async def _stream_placed(self, call: WorkerCall, reply: RouteReply, meta: StreamMeta,
                             context) -> AsyncIterator[dict]:
        """Stream from the worker the router chose; always releases the placement."""
        started = time.monotonic()
        outcome = "error"
        state: dict = {}
        tokens = 0
        due = PROGRESS_TOKENS
        try:
            client = await self.worker_client(reply.endpoint, reply.worker_id)
            async for chunk in stream_from_worker(client, call, reply.worker_id, context,
                                                  state, self.stall_s):
                ids = chunk.get("token_ids")
                if ids:
                    before, tokens = tokens, tokens + len(ids)
                    if before == 0 or tokens >= due:
                        first, progress, wake, due = due_reports(before, tokens, due)
                        self._report(meta, tokens, first, progress, wake)
                yield chunk
            outcome = "ok"
        except GeneratorExit:
            outcome = "ok" if state.get("finished") else "cancelled"
            raise
        except WorkerUnreachable:
            outcome = "unreachable"
            raise
        except Exception as exc:  # noqa: BLE001
            raise upstream_error(f"worker {reply.worker_id:x} failed: {exc}") from None
        finally:
            self._release(meta, outcome, started)

    def _report(self, meta: StreamMeta, tokens: int, first: bool, progress: bool,
                wake: bool) -> None:
        """The request's first token came back (``first``) or ``tokens`` output tokens
        have streamed (``progress``): tell the router replica that placed it, batched."""
        if self.progress_feed is not None:
            try:
                self.progress_feed.report(meta.router_id, meta.request_id, meta.worker_id,
                                          tokens, first, progress, wake)
            except Exception:  # a report is never worth the answer
                log.exception("progress report of %s failed", meta.request_id)

    def _release(self, meta: StreamMeta, outcome: str, started: float) -> None:
        call = ReleaseCall(
            request_id=meta.request_id, worker_id=meta.worker_id or 0, outcome=outcome,
            prompt_tokens=meta.prompt_tokens, cached_tokens=meta.cached_tokens,
            output_tokens=meta.output_tokens,
            ttft_s=(meta.first_token_at - started) if meta.first_token_at else None,
            duration_s=time.monotonic() - started)
        self.deliver_release(call, meta)

    def deliver_release(self, call: ReleaseCall, meta: StreamMeta) -> None:
        """Send ``call`` to the router replica that placed the request, in the
        background (the client's response does not wait for it)."""
        task = asyncio.ensure_future(self._send_release(call, meta.router_id))
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

    async def _send_release(self, call: ReleaseCall, router_id: int | None) -> None:
        """Tell the replica that placed the request; if it has left discovery (its
        accounting left with it), any replica still learns the outcome."""
        if self.release_client is None:
            return
        payload = call.model_dump(mode="json")
        try:
            if router_id is not None and router_id in self.release_client.instance_ids():
                stream = await self.release_client.direct(payload, router_id)
            else:
                stream = await self.release_client.round_robin(payload)
            async for _ in stream:
                pass
        except Exception as exc:  # noqa: BLE001 - the router expires unreleased requests
            log.debug("release of %s failed: %s", call.request_id, exc)
