"""`engine: vllm` for the aggregated Worker: vLLM behind Dynamo's runtime.

Serves the same `generate` protocol as the torch worker, relays vLLM's KV events to the
routers through Dynamo's KvEventPublisher, and publishes load reports over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator

from splitserve.components.engines.interface import GenerateParams, TokenDelta, params_from_wire
from splitserve.components.protocol import WorkerLoad, WorkerRequest, load_subject, output_chunk
from splitserve.components.worker.cancel import until_stopped
from splitserve.components.worker.fatal import leave_after_engine_failure
from splitserve.components.worker.loadreport import ReportFailures, publish_load
from splitserve.components.worker.metrics import WorkerMetrics
from splitserve.components.worker.readiness import report_ready_when_registered
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .config import VllmWorkerSection
from .engine import VllmEngine

log = logging.getLogger("splitserve.vllm")

FINISH = {"stop": "eos", "length": "length", "abort": "cancelled", "error": "error"}


def generate_params(wreq: WorkerRequest) -> GenerateParams:
    """Map the wire request onto the engine interface's request."""
    return params_from_wire(wreq)


async def stream_chunks(deltas: AsyncIterator[TokenDelta], metrics: WorkerMetrics,
                        context=None) -> AsyncIterator[dict]:
    """Wire chunks for one request; closing this or stopping ``context`` (client gone)
    closes ``deltas``, which aborts the request in the engine."""
    produced = 0
    try:
        async for d in until_stopped(deltas, context):
            produced += len(d.token_ids)
            if d.finished:
                metrics.requests.labels(d.finish_reason or "stop").inc()
                yield output_chunk(list(d.token_ids), FINISH.get(d.finish_reason, "eos"),
                                   prompt_tokens=d.prompt_tokens,
                                   cached_tokens=d.cached_tokens, completion_tokens=produced,
                                   logprobs=d.logprobs, prompt_logprobs=d.prompt_logprobs)
                return
            yield output_chunk(list(d.token_ids), logprobs=d.logprobs,
                               prompt_logprobs=d.prompt_logprobs)
    except Exception as exc:  # noqa: BLE001 - the engine failed this request
        metrics.requests.labels("error").inc()
        yield output_chunk([], "error", error=str(exc))
    finally:
        with contextlib.suppress(Exception):
            await deltas.aclose()


def make_handler(engine: VllmEngine, metrics: WorkerMetrics):
    """The `generate` endpoint handler."""

    async def generate(request: dict, context=None):
        try:
            wreq = WorkerRequest.model_validate(request)
            rid = wreq.meta().request_id or uuid.uuid4().hex
            deltas = engine.generate(rid, generate_params(wreq))
        except Exception as exc:  # noqa: BLE001 - bad request or engine gone
            metrics.requests.labels("rejected").inc()
            yield output_chunk([], "error", error=f"request refused: {exc}")
            return
        async for chunk in stream_chunks(deltas, metrics, context):
            yield chunk

    return generate


def publish_kv_events(publisher, events: list) -> None:
    """Forward converted BlockStored / BlockRemoved events to Dynamo's publisher."""
    for ev in events:
        if hasattr(ev, "token_ids"):
            publisher.publish_stored(list(ev.token_ids), list(ev.num_block_tokens),
                                     list(ev.block_hashes), ev.parent_hash)
        else:
            publisher.publish_removed(list(ev.block_hashes))


async def watch_engine(ctx: ComponentContext, engine: VllmEngine, endpoint,
                       interval_s: float = 1.0, leave=leave_after_engine_failure) -> None:
    """Leave (so the supervisor restarts this replica) once vLLM's engine process died:
    a registered worker whose engine is dead would answer every request with an error.
    Returns without leaving once the worker is stopping."""
    while not ctx.stopping.is_set():
        exc = engine.failure()
        if exc is not None:
            await leave(exc, ctx.report, endpoint.unregister_endpoint_instance)
            return
        await asyncio.sleep(interval_s)


async def run_vllm_worker(ctx: ComponentContext, cfg: VllmWorkerSection) -> None:
    """Component main for ``engine: vllm`` (aggregated serving)."""
    ctx.report("loading", detail="starting vLLM")
    engine = VllmEngine(cfg.engine_args, ctx.run.common.model)
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    tasks: list[asyncio.Task] = []
    if engine.kv_endpoint is not None:
        from dynamo.llm import KvEventPublisher

        publisher = KvEventPublisher(endpoint, kv_block_size=cfg.engine_args.block_size)
        # Listening before vLLM starts: its publisher connects to this socket.
        relay_ready = asyncio.Event()
        tasks.append(asyncio.create_task(engine.run_kv_events(
            lambda evs: publish_kv_events(publisher, evs), relay_ready)))
        await asyncio.wait_for(relay_ready.wait(), 10)
    await engine.start()
    metrics = WorkerMetrics()
    ctx.serve_metrics(metrics.registry)
    worker_id = endpoint.connection_id()

    def sample() -> WorkerLoad:
        ld = engine.load()
        metrics.update(ld.active, ld.waiting, ld.kv_used_blocks, ld.kv_total_blocks)
        return WorkerLoad(worker_id=worker_id, active=ld.active, waiting=ld.waiting,
                          kv_used_blocks=ld.kv_used_blocks, kv_total_blocks=ld.kv_total_blocks)

    reporter = asyncio.create_task(publish_load(
        os.environ["NATS_SERVER"], load_subject(ctx.namespace, ctx.run.component), sample,
        cfg.load_report_interval_s, ctx.stopping, ReportFailures(metrics.load_report_failures)))
    tasks.append(reporter)
    tasks.append(asyncio.create_task(report_ready_when_registered(
        ctx.report, endpoint, worker_id,
        endpoint=f"{ctx.namespace}.{ctx.run.component.lower()}.generate",
        detail=f"instance {worker_id:x} (vLLM)")))
    tasks.append(asyncio.create_task(watch_engine(ctx, engine, endpoint)))
    try:
        await serve_until_stopped(ctx, endpoint, make_handler(engine, metrics),
                                  drain_timeout_s=cfg.drain_timeout_s, inflight=engine.inflight)
    finally:
        await engine.shutdown(drain_timeout_s=0.0)
        # The load reporter ends on its own after its last ("draining") report.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(reporter), 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
