"""The aggregated Worker process around any in-process engine of the interface
(SGLang, TensorRT-LLM): serve `generate`, relay KV events to the routers, publish load.

The same shell as the vLLM worker (its request mapping and chunk stream are reused);
only the engine object differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from splitserve.components.engines.vllm.worker import make_handler, publish_kv_events
from splitserve.components.protocol import WorkerLoad, load_subject
from splitserve.components.worker.engine_hosts import _watch_failure
from splitserve.components.worker.engine_processes import _serve_or_die
from splitserve.components.worker.loadreport import ReportFailures, publish_load
from splitserve.components.worker.metrics import WorkerMetrics
from splitserve.components.worker.readiness import report_ready_when_registered
from splitserve.serve.component import ComponentContext, serve_until_stopped


async def run_engine_worker(ctx: ComponentContext, cfg, engine, label: str) -> None:
    """Component main of an aggregated Worker with ``engine`` (not started yet)."""
    ctx.report("loading", detail=f"starting {label}")
    endpoint = ctx.endpoint(ctx.run.component, "generate")
    tasks: list[asyncio.Task] = []
    from dynamo.llm import KvEventPublisher

    publisher = KvEventPublisher(endpoint, kv_block_size=engine.info.kv_block_size)
    relay_ready = asyncio.Event()  # the relay listens before the engine starts
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
    # ready once discovery lists this instance: before that the router cannot reach it
    tasks.append(asyncio.create_task(report_ready_when_registered(
        ctx.report, endpoint, worker_id,
        endpoint=f"{ctx.namespace}.{ctx.run.component.lower()}.generate",
        detail=f"instance {worker_id:x} ({label})")))
    # An engine that dies on its own (``failure()``: TensorRT-LLM's executor) ends the
    # replica with its error, which the supervisor restarts.
    died = asyncio.ensure_future(_watch_failure(engine))
    serving = asyncio.ensure_future(serve_until_stopped(
        ctx, endpoint, make_handler(engine, metrics),
        drain_timeout_s=cfg.drain_timeout_s, inflight=engine.inflight))
    tasks += [died, serving]  # cancelled below; serving is done unless the engine died
    try:
        await _serve_or_die(serving, died)
    finally:
        await engine.shutdown(drain_timeout_s=0.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(reporter), 5)
        for t in [*tasks, reporter]:
            t.cancel()
        await asyncio.gather(*tasks, reporter, return_exceptions=True)


async def run_sglang_worker(ctx: ComponentContext, cfg) -> None:
    """``engine: sglang`` for the aggregated Worker."""
    from splitserve.components.engines.sglang.engine import SglangEngine

    engine = SglangEngine(cfg.engine_args, ctx.run.common.model, "agg",
                          host=ctx.run.common.bind_host)
    await run_engine_worker(ctx, cfg, engine, "SGLang")


async def run_trtllm_worker(ctx: ComponentContext, cfg) -> None:
    """``engine: trtllm`` for the aggregated Worker."""
    from splitserve.components.engines.trtllm.engine import TrtllmEngine

    engine = TrtllmEngine(cfg.engine_args, ctx.run.common.model, "agg")
    await run_engine_worker(ctx, cfg, engine, "TensorRT-LLM")
