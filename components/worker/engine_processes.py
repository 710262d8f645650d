"""DecodeWorker and PrefillWorker processes around an in-process engine of the interface
(``engine: sglang`` / ``engine: trtllm``): the adapters for the decode coordinator
(``coordinator.py``) and the prefill loop (``prefill_loop.py``).

Same endpoints as the torch and mocker workers: a decode worker serves
``<ns>.decodeworker.generate`` and ``explain`` and takes prefill handoffs on its NATS
handoff subject; a prefill worker pulls jobs and serves a presence endpoint on
``<ns>.prefillworker.generate`` by which decode workers count live prefill workers.
"""

from __future__ import annotations

import asyncio
import logging
import os

from prometheus_client import CollectorRegistry

from splitserve.components.protocol import WorkerLoad, load_subject
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .disagg_metrics import DisaggMetrics, PrefillMetrics
from .loadreport import publish_load
from .metrics import WorkerMetrics
from .readiness import report_ready_when_registered

log = logging.getLogger("splitserve.engine_worker")


def engine_decode_section(engine: str) -> type:
    """The DecodeWorker section model of ``engine`` (sglang or trtllm)."""
    if engine == "sglang":
        from splitserve.components.engines.sglang.sections import SglangDecodeWorkerConfig

        return SglangDecodeWorkerConfig
    from splitserve.components.engines.trtllm.sections import TrtllmDecodeWorkerConfig

    return TrtllmDecodeWorkerConfig


def engine_prefill_section(engine: str) -> type:
    """The PrefillWorker section model of ``engine`` (sglang or trtllm)."""
    if engine == "sglang":
        from splitserve.components.engines.sglang.sections import SglangPrefillWorkerConfig

        return SglangPrefillWorkerConfig
    from splitserve.components.engines.trtllm.sections import TrtllmPrefillWorkerConfig

    return TrtllmPrefillWorkerConfig


def make_engine(ctx: ComponentContext, cfg, role: str):
    """The section's engine object for ``role`` (decode or prefill), not started."""
    model, host = ctx.run.common.model, ctx.run.common.bind_host
    if cfg.engine == "sglang":
        from splitserve.components.engines.sglang.engine import SglangEngine

        local = (SglangEngine(cfg.engine_args, model, "agg", host=host)
                 if role == "decode" and cfg.local_prefill_engine else None)
        return SglangEngine(cfg.engine_args, model, role, host=host, local_prefill=local)
    if cfg.engine == "trtllm":
        from splitserve.components.engines.trtllm.engine import TrtllmEngine

        return TrtllmEngine(cfg.engine_args, model, role)
    raise ValueError(f"engine {cfg.engine!r} has no decode coordinator yet")


def coordinator_settings(cfg):
    """The coordinator's timings from a decode worker section."""
    from .coordinator import CoordinatorSettings

    return CoordinatorSettings(remote_prefill_timeout_s=cfg.remote_prefill_timeout_s,
                               max_wait_for_prefill_worker_s=cfg.no_prefill_worker_wait_s,
                               retry_after_s=cfg.retry_after_s)


async def run_engine_decode_worker(ctx: ComponentContext, cfg) -> None:
    """Component main of a DecodeWorker with an interface engine."""
    from dynamo.llm import KvEventPublisher

    from splitserve.common.connect import connect_nats
    from splitserve.components.disagg import build_decider
    from splitserve.components.engines.vllm.worker import publish_kv_events
    from splitserve.components.mocker_worker.handoff import HandoffInbox, handoff_subject
    from splitserve.components.prefill_queue import PrefillQueue

    from .coordinator import EngineDecodeCoordinator

    ns, component, nats_url = ctx.namespace, ctx.run.component, os.environ["NATS_SERVER"]
    decider = build_decider(cfg.disaggregated_router)
    engine = make_engine(ctx, cfg, "decode")
    ctx.report("loading", detail=f"starting {engine.info.name} (decode)")
    endpoint = ctx.endpoint(component, "generate")
    worker_id = endpoint.connection_id()
    tasks: list[asyncio.Task] = []
    cleanup: list = []
    try:
        publisher = KvEventPublisher(endpoint, kv_block_size=engine.info.kv_block_size)
        relay_ready = asyncio.Event()
        tasks.append(asyncio.create_task(engine.run_kv_events(
            lambda evs: publish_kv_events(publisher, evs), relay_ready)))
        await asyncio.wait_for(relay_ready.wait(), 10)
        await engine.start()
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="engine-decode")
        cleanup.append(queue.close)
        depth = queue.depth_monitor()
        await depth.start()
        cleanup.append(depth.stop)
        inbox = HandoffInbox()
        subject = handoff_subject(ns, component, worker_id)
        nc = await connect_nats(nats_url, name="engine-decode-handoff")
        cleanup.append(nc.drain)
        await nc.subscribe(subject, cb=inbox.on_message)
        prefill_client = await ctx.endpoint("PrefillWorker", "generate").client()
        metrics = WorkerMetrics()
        ctx.serve_metrics(metrics.registry)
        coord = EngineDecodeCoordinator(
            engine, decider, queue, inbox, subject, worker_id,
            live_prefill_workers=lambda: len(prefill_client.instance_ids()),
            queue_depth=lambda: depth.depth or 0, metrics=DisaggMetrics(metrics.registry),
            settings=coordinator_settings(cfg))

        def sample() -> WorkerLoad:
            ld = engine.load()
            metrics.update(ld.active, ld.waiting + inbox.waiting, ld.kv_used_blocks,
                           ld.kv_total_blocks)
            return WorkerLoad(worker_id=worker_id, active=ld.active,
                              waiting=ld.waiting + inbox.waiting,
                              kv_used_blocks=ld.kv_used_blocks,
                              kv_total_blocks=ld.kv_total_blocks)

        tasks.append(asyncio.create_task(publish_load(
            nats_url, load_subject(ns, component), sample, cfg.load_report_interval_s,
            ctx.stopping)))
        tasks.append(asyncio.ensure_future(
            ctx.endpoint(component, "explain").serve_endpoint(coord.explain)))
        tasks.append(asyncio.create_task(report_ready_when_registered(
            ctx.report, endpoint, worker_id, endpoint=f"{ns}.{component.lower()}.generate",
            detail=f"instance {worker_id:x} ({engine.info.name}), handoff {subject}")))
        await serve_until_stopped(ctx, endpoint, coord.generate,
                                  drain_timeout_s=cfg.drain_timeout_s,
                                  inflight=lambda: coord.inflight)
    finally:
        await _close(tasks, cleanup)
        await engine.shutdown(drain_timeout_s=0.0)


async def run_engine_prefill_worker(ctx: ComponentContext, cfg) -> None:
    """Component main of a PrefillWorker with an interface engine; exits non-zero when
    its pull loop fails."""
    from splitserve.common.connect import connect_nats
    from splitserve.components.prefill_queue import PrefillQueue

    from .prefill_loop import PrefillLoopSettings, pull_loop

    ns, component, nats_url = ctx.namespace, ctx.run.component, os.environ["NATS_SERVER"]
    engine = make_engine(ctx, cfg, "prefill")
    ctx.report("loading", detail=f"starting {engine.info.name} (prefill)")
    await engine.start()
    endpoint = ctx.endpoint(component, "generate")
    worker_id = endpoint.connection_id()
    settings = PrefillLoopSettings(max_concurrent_jobs=cfg.max_concurrent_jobs,
                                   heartbeat_s=cfg.prefill_queue.ack_wait_s / 3,
                                   drain_timeout_s=cfg.drain_timeout_s)
    tasks: list[asyncio.Task] = []
    cleanup: list = []
    try:
        metrics = PrefillMetrics(CollectorRegistry())
        ctx.serve_metrics(metrics.registry)
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="engine-prefill")
        cleanup.append(queue.close)
        nc = await connect_nats(nats_url, name="engine-prefill-handoff")
        cleanup.append(nc.drain)
        puller = asyncio.create_task(pull_loop(engine, nc, queue, settings, worker_id,
                                               metrics, ctx.stopping))
        tasks.append(puller)

        async def presence(request: dict, context=None):
            # Decode workers count live prefill workers by this endpoint's instances.
            yield {"ok": True, "engine": engine.info.name, "worker": f"{worker_id:x}"}

        tasks.append(asyncio.create_task(report_ready_when_registered(
            ctx.report, endpoint, worker_id, endpoint=f"{ns}.{component.lower()}.generate",
            detail=f"instance {worker_id:x} ({engine.info.name})")))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, endpoint, presence, drain_timeout_s=cfg.drain_timeout_s,
            inflight=engine.inflight))
        tasks.append(serving)
        await asyncio.wait({serving, puller}, return_when=asyncio.FIRST_COMPLETED)
        if puller.done() and not ctx.stopping.is_set():
            puller.result()  # surface the pull loop's error
            raise RuntimeError("the pull loop ended while serving")
        await serving
        await asyncio.wait_for(puller, cfg.drain_timeout_s + 5)  # jobs in hand finish
    finally:
        await _close(tasks, cleanup)
        await engine.shutdown(drain_timeout_s=0.0)


async def _close(tasks: list[asyncio.Task], cleanup: list) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for close in reversed(cleanup):
        try:
            await asyncio.wait_for(close(), 5)
        except Exception as exc:  # noqa: BLE001 - shutdown continues regardless
            log.warning("cleanup step failed: %s", exc)
