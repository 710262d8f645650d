"""Live KV moves in the aggregated shell (engines whose ``capabilities.moves_kv`` is set:
torch with an agent).

A replica whose drain deadline passes with requests still running *parks* each one: the
engine stops it between steps and keeps its KV, the shell ends its stream with a
``drained`` chunk that names the parked KV (and carries any output not sent yet), and
the frontend continues the request on another replica with a ``kv_source``.  That
replica reserves blocks for the request's tokens so far and asks the parked replica's
``kv_export`` endpoint to write them over NIXL; then it decodes on from the last token.
A move that fails anywhere (the source gone, no free blocks, a timeout) recomputes the
tokens instead, so the client never sees it.  The drained replica serves ``kv_export``
until its parked requests are read or ``kv_move_hold_s`` has passed.

The engine does the KV work (``components/engines/torch_cpu/adapter.py``); this module
is the wiring: the endpoint, the client, the metrics (docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.contracts import tracing
from splitserve.contracts.metrics import PREFIX
from splitserve.contracts.kit.waiting import poll_until
from splitserve.contracts.engine import (
    Engine,
    GenerateParams,
    TokenDelta,
    TorchBlocksHandoff,
)
from splitserve.contracts.wire import KvSource, chunk_data, drained_chunk

log = logging.getLogger("splitserve.worker")

EXPORT_ENDPOINT = "kv_export"
"""The endpoint a replica serves for reading the KV it parked."""


async def start_kv_moves(ctx, engine: Engine, registry: CollectorRegistry,
                         tasks: list[asyncio.Future]) -> KvMoves | None:
    """A replica's live KV moves when its engine does them (``capabilities.moves_kv``):
    the client to its component's ``kv_export`` endpoint and that endpoint served (added
    to ``tasks``); None otherwise.  Called by the aggregated and the decode shells."""
    caps = engine.info.capabilities
    if not caps.moves_kv:
        return None
    export = ctx.endpoint(ctx.run.component, EXPORT_ENDPOINT)
    moves = KvMoves(engine, await export.client(), registry,
                    fetch_timeout_s=caps.kv_move_timeout_s)
    tasks.append(asyncio.ensure_future(export.serve_endpoint(moves.export)))
    return moves


class KvMoveMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.outcomes = Counter(
            f"{PREFIX}_worker_kv_moves_total", "Live KV moves by outcome: parked (this "
            "replica kept a drained request's KV), exported (wrote it to the replica that "
            "continues it), moved (continued a request from moved KV), recomputed (a move "
            "failed and the tokens were recomputed)", ["outcome"], registry=registry)
        self.fetch_seconds = Histogram(
            f"{PREFIX}_worker_kv_move_fetch_seconds", "From asking the parked replica for "
            "a request's KV until it was written here",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry)


class KvMoves:
    """One replica's side of live KV moves: parking on the drain cut, exporting what it
    parked, fetching what another replica parked."""

    def __init__(self, engine, export_client, registry: CollectorRegistry,
                 fetch_timeout_s: float = 10.0) -> None:
        self.engine = engine
        self.client = export_client
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = KvMoveMetrics(registry)
        self.announcing = 0
        """Streams parked whose ``drained`` chunk has not gone out yet (they count as in
        flight for the drain)."""

    # ---- the drained replica ----------------------------------------------------------
    async def park(self, request_id: str) -> tuple[tuple[int, ...], dict] | None:
        """Park ``request_id`` (the engine's id for it): its tokens and the ``kv`` of its
        drained chunk, or None when it cannot move (it is then ended as usual)."""
        parked = await self.engine.park(request_id)
        if parked is None:
            return None
        eid, tokens = parked
        self.metrics.outcomes.labels("parked").inc()
        return tokens, {"request_id": eid, "tokens": len(tokens) - 1}

    async def export(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The ``kv_export`` handler: write a parked request's KV where the continuing
        replica reserved it; one reply, ``{"ok": true, ...}`` or ``{"error": ...}``."""
        span = tracing.start("kv_export", tracing.from_dynamo(context), {
            "splitserve.request_id": str(request.get("request_id"))}, kind="server"
        ) if tracing.enabled() else tracing.NOOP
        try:
            dest = TorchBlocksHandoff.model_validate(request["destination"])
            res = await self.engine.export_parked(str(request["request_id"]), dest,
                                                  str(request["notify_id"]))
        except Exception as exc:  # noqa: BLE001 - the asking replica recomputes
            log.warning("KV export of %s failed: %s", request.get("request_id"), exc)
            self.metrics.outcomes.labels("export_failed").inc()
            span.end(error=f"{type(exc).__name__}: {exc}")
            yield {"error": f"{type(exc).__name__}: {exc}"}
            return
        self.metrics.outcomes.labels("exported").inc()
        span.end({"splitserve.kv.bytes": res.nbytes, "splitserve.kv.transfer_s": res.seconds,
                  "splitserve.kv.path": res.path})
        yield {"ok": True, "nbytes": res.nbytes, "seconds": res.seconds, "path": res.path}

    def inflight(self, engine_inflight: Callable[[], int]) -> Callable[[], int]:
        """The drain's in-flight count: the engine's, plus parked streams whose drained
        chunk has not gone out."""
        return lambda: engine_inflight() + self.announcing

    async def wait_exported(self, hold_s: float) -> None:
        """After the drain: serve ``kv_export`` until nothing is parked or ``hold_s``
        passed (the engine frees what nobody came for)."""
        if self.engine.parked():
            log.info("waiting up to %.0f s for %d parked requests to be read",
                     hold_s, self.engine.parked())
            await poll_until(lambda: not self.engine.parked(), hold_s)

    # ---- the continuing replica -------------------------------------------------------
    def resume(self, request_id: str, params: GenerateParams, source: KvSource,
               trace=tracing.NOOP) -> AsyncIterator[TokenDelta]:
        """The request's deltas, continued from the KV at ``source`` (or recomputed);
        ``trace``: the request's span, under which the move's is recorded."""
        if source.tokens != len(params.token_ids) - 1:
            log.warning("request %s: the parked KV holds %d tokens, the request has %d; "
                        "recomputing", request_id, source.tokens, len(params.token_ids))
            self.metrics.outcomes.labels("recomputed").inc()
            return self.engine.generate(request_id, params)
        return self.engine.resume_moved(request_id, params, self._fetcher(source, trace),
                                        lambda o: self.metrics.outcomes.labels(o).inc())

    def _fetcher(self, source: KvSource, trace=tracing.NOOP
                 ) -> Callable[[TorchBlocksHandoff, str], Awaitable[None]]:
        async def fetch(handoff: TorchBlocksHandoff, notify_id: str) -> None:
            t0 = time.monotonic()
            span = trace.child("kv_move", {"splitserve.kv.source_worker_id":
                                           f"{source.worker_id:x}",
                                           "splitserve.kv.tokens": source.tokens}
                               if trace else None, kind="client")
            payload = {"request_id": source.request_id, "notify_id": notify_id,
                       "destination": handoff.model_dump(mode="json")}
            try:
                reply = await asyncio.wait_for(self._ask(payload, source.worker_id, span),
                                               self.fetch_timeout_s)
            except BaseException as exc:
                span.end(error=f"{type(exc).__name__}: {exc}")
                raise
            if not isinstance(reply, dict) or not reply.get("ok"):
                span.end(error="not exported")
                raise RuntimeError(f"replica {source.worker_id:x} did not export the KV: "
                                   f"{reply.get('error') if isinstance(reply, dict) else reply}")
            self.metrics.fetch_seconds.observe(time.monotonic() - t0)
            span.end({"splitserve.kv.bytes": reply.get("nbytes"),
                      "splitserve.kv.transfer_s": reply.get("seconds")})
        return fetch

    async def _ask(self, payload: dict, worker_id: int, trace=tracing.NOOP) -> Any:
        ctx = tracing.dynamo_context(trace)  # the kv_export handler continues the trace
        stream = await (self.client.direct(payload, worker_id) if ctx is None else
                        self.client.direct(payload, worker_id, context=ctx))
        async for item in stream:
            return chunk_data(item)
        return None


class DrainCut:
    """One request's view of its replica's drain cut (``ComponentContext.drain_cut``):
    ``stop`` is what its stream stops on, and ``drained_chunk`` the chunk that ends it
    once the cut came (``came``).  With live KV moves the request is parked first: its
    stream stops once that is done, and the drained chunk names the KV and carries the
    output the engine made but the stream had not sent (its tokens after
    ``prompt_tokens`` and the ``produced`` ones).  Without a cut nothing stops it."""

    def __init__(self, cut: asyncio.Event | None, moves: KvMoves | None = None,
                 request_id: str | Callable[[], str] = "", prompt_tokens: int = 0) -> None:
        self.cut = cut
        self.moves = moves
        self.prompt_tokens = prompt_tokens
        self.parked: tuple[tuple[int, ...], dict] | None = None
        self._announced = False
        self._task: asyncio.Future | None = None
        self.stop = cut
        if cut is not None and moves is not None:
            self.stop = asyncio.Event()
            self._task = asyncio.ensure_future(self._park_on(cut, request_id))

    @property
    def came(self) -> bool:
        return self.cut is not None and self.cut.is_set()

    async def _park_on(self, cut: asyncio.Event, request_id: str | Callable[[], str]
                       ) -> None:
        await cut.wait()
        if callable(request_id):  # the engine's id is known only now (a local fallback)
            request_id = request_id()
        try:
            self.parked = await self.moves.park(request_id)
        except Exception as exc:  # noqa: BLE001 - ended as usual instead
            log.warning("parking drained request %s failed: %s", request_id, exc)
        if self.parked is not None:
            self._announced = True
            self.moves.announcing += 1
        self.stop.set()

    def drained_chunk(self, produced: int) -> dict:
        if self.parked is None:
            return drained_chunk()
        tokens, kv = self.parked
        return drained_chunk(list(tokens[self.prompt_tokens + produced:]), kv)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._announced:
            self._announced = False
            self.moves.announcing -= 1
