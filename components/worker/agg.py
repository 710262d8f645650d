"""The aggregated shell: one Worker replica serving `generate` on any engine.

``python -m splitserve.components.worker.main`` runs it.  The registry's host brings the
engine up (with its KV-event relay); this shell serves `generate` (one engine request
per wire request, streamed delta by delta; the client leaving aborts it), publishes load
reports, reports ready once discovery lists the instance, and drains on stop.  An
engine that serves `generate` itself (the mocker's child) runs its own main instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from splitserve.contracts import tracing
from splitserve.contracts.engine import Engine, TokenDelta
from splitserve.contracts.wire import FinishReason, WorkerRequest, output_chunk
from splitserve.contracts.kit.component import ComponentContext, serve_until_stopped

from . import registry
from .cancel import until_stopped
from .kv_moves import DrainCut, KvMoves, start_kv_moves
from .latency_metrics import TokenClock, TokenLatency, worker_labels
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from .shell import (
    cancel_all,
    report_ready,
    serve_or_die,
    start_adapters,
    start_load_reports,
)
from .wire import check_adapter, delta_chunk, params_from_wire

log = logging.getLogger("splitserve.worker")


async def stream_chunks(deltas: AsyncIterator[TokenDelta], metrics: WorkerMetrics,
                        context=None, drain: DrainCut | None = None, *,
                        clock: TokenClock | None = None) -> AsyncIterator[dict]:
    """Wire chunks for one request; closing this or stopping ``context`` (client gone)
    closes ``deltas``, which aborts the request in the engine.  The drain cut (``drain``)
    ends it the same way, with a ``drained`` chunk (naming the KV when it was parked).
    ``clock``: the request's TTFT and ITL timing, given each delta's tokens."""
    produced = 0
    try:
        async for d in until_stopped(deltas, context, drain.stop if drain else None):
            produced += len(d.token_ids)
            if clock is not None:
                clock.tokens(len(d.token_ids))
            if d.finished:
                metrics.requests.labels((d.finish_reason or FinishReason.EOS).value).inc()
            yield delta_chunk(d, produced)
            if d.finished:
                return
        if drain is not None and drain.came:
            metrics.requests.labels("drained").inc()
            yield drain.drained_chunk(produced)
    except Exception as exc:  # noqa: BLE001 - the engine failed this request
        log.info("request failed in the engine: %s", exc)
        metrics.requests.labels(FinishReason.ERROR.value).inc()
        yield output_chunk([], FinishReason.ERROR, error=str(exc))
    finally:
        if drain is not None:
            drain.close()
        try:
            await deltas.aclose()
        except Exception as exc:  # noqa: BLE001 - the request is over either way
            log.warning("closing an engine stream failed: %s", exc)


def make_handler(engine: Engine, metrics: WorkerMetrics, cut: asyncio.Event | None = None,
                 moves: KvMoves | None = None, latency: TokenLatency | None = None,
                 worker_id: int | None = None):
    """The `generate` endpoint handler: the request is checked (``engine.validate``)
    before anything is queued, then streamed; ``cut``: the component's drain cut
    (``ComponentContext.drain_cut``); ``moves``: live KV moves (a request with a
    ``kv_source`` continues from that KV; the cut parks requests); ``latency``: this
    worker's TTFT and ITL by pool and model (None: not timed).  With tracing on, each
    request is a ``generate`` span under the frontend's (Dynamo's context), with its
    first-token time, output tokens and outcome."""

    async def generate(request: dict, context=None):
        clock = None
        trace = tracing.start("generate", tracing.from_dynamo(context), {
            "splitserve.worker_id": f"{worker_id:x}" if worker_id is not None else ""},
            kind="server") if tracing.enabled() else tracing.NOOP
        try:
            wreq = WorkerRequest.model_validate(request)
            meta = wreq.meta()
            rid = meta.request_id or uuid.uuid4().hex
            params = params_from_wire(wreq)
            check_adapter(params, engine.info)
            engine.validate(params)
            resumed = moves is not None and meta.kv_source is not None
            if latency is not None:
                clock = latency.clock(first_token=not resumed)
            if resumed:
                deltas = moves.resume(rid, params, meta.kv_source, trace)
            else:
                deltas = engine.generate(rid, params)
        except Exception as exc:  # noqa: BLE001 - bad request or engine gone
            metrics.requests.labels("rejected").inc()
            trace.end({"splitserve.outcome": "rejected"}, error="rejected")
            yield output_chunk([], FinishReason.ERROR, error=f"request refused: {exc}")
            return
        trace.set({"splitserve.request_id": rid,
                   "splitserve.prompt_tokens": len(params.token_ids)})
        drain = DrainCut(cut, moves, rid, len(params.token_ids))
        produced, outcome = 0, FinishReason.CANCELLED.value
        try:
            async for chunk in stream_chunks(deltas, metrics, context, drain, clock=clock):
                if chunk.get("token_ids") and not produced:
                    trace.event("first_token")
                produced += len(chunk.get("token_ids") or ())
                outcome = chunk.get("finish_reason") or outcome
                yield chunk
        finally:
            trace.end({"splitserve.output_tokens": produced, "splitserve.outcome": outcome},
                      error=outcome if outcome == FinishReason.ERROR.value else None)

    return generate


async def register_model_card(ctx: ComponentContext, h) -> None:
    """Register a Dynamo model card for this replica (``dynamo_model_card``): Dynamo's
    frontend then discovers it, tokenises with the model's own files and sends its
    preprocessed requests, which the generate endpoint takes as they are."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_llm

    from splitserve.contracts import model_files

    common = ctx.run.common
    path = model_files.model_dir(common.model)
    await register_llm(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, h.endpoint,
                       str(path), common.served_model_name,
                       kv_cache_block_size=h.engine.info.kv_block_size,
                       worker_type=WorkerType.Aggregated)
    log.info("registered a Dynamo model card for %s (%s)", common.served_model_name, path)


async def run_aggregated(ctx: ComponentContext, cfg) -> None:
    """Component main of a Worker replica; exits non-zero when its engine dies."""
    entry = registry.spec(cfg.engine)
    if entry.serves_agg is not None:
        await registry.resolve(entry.serves_agg)(ctx, cfg)
        return
    async with contextlib.AsyncExitStack() as stack:
        h = await registry.host_engine(ctx, cfg, "agg", stack)
        if h is None:
            return
        tasks: list[asyncio.Future] = []
        stack.push_async_callback(cancel_all, tasks)
        adapters = start_adapters(ctx, h, cfg, tasks)
        reporter = start_load_reports(ctx, h, cfg.load_report_interval_s, adapters=adapters)
        tasks += [reporter, report_ready(ctx, h)]
        moves = await start_kv_moves(ctx, h.engine, h.metrics.registry, tasks)
        inflight = h.engine.inflight if moves is None else moves.inflight(h.engine.inflight)
        latency = TokenLatency(h.metrics.registry, *worker_labels(ctx.run))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, h.endpoint, make_handler(h.engine, h.metrics, ctx.drain_cut, moves, latency,
                                          h.worker_id),
            drain_timeout_s=cfg.drain_timeout_s, inflight=inflight))
        tasks.append(serving)
        if cfg.dynamo_model_card:
            await register_model_card(ctx, h)
        await serve_or_die(serving, h.died)
        if moves is not None:
            await moves.wait_exported(cfg.kv_move_hold_s)
        await asyncio.wait({reporter}, timeout=5)  # its last report says "draining"
