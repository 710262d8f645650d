"""The DecodeWorker and PrefillWorker processes of every engine (torch, mocker, vLLM,
SGLang, TensorRT-LLM): the shells around the decode coordinator (``coordinator.py``)
and the prefill loop (``prefill_loop.py``); ``engine_hosts.py`` brings each kind of
engine up, ``make_engine`` builds the in-process ones.

A decode worker serves ``<ns>.decodeworker.generate`` and ``explain`` and takes prefill
handoffs on its NATS handoff subject; a prefill worker pulls jobs and serves a presence
endpoint on ``<ns>.prefillworker.generate`` by which decode workers count live prefill
workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from splitserve.components.protocol import WorkerLoad, load_subject
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .disagg_metrics import DisaggMetrics, PrefillMetrics
from .loadreport import ReportFailures, publish_load
from .readiness import report_ready_when_registered

log = logging.getLogger("splitserve.engine_worker")


def engine_decode_section(engine: str) -> type:
    """The DecodeWorker section model of ``engine`` (vllm, sglang or trtllm)."""
    if engine == "vllm":
        from splitserve.components.engines.vllm.sections import VllmDecodeWorkerConfig

        return VllmDecodeWorkerConfig
    if engine == "sglang":
        from splitserve.components.engines.sglang.sections import SglangDecodeWorkerConfig

        return SglangDecodeWorkerConfig
    from splitserve.components.engines.trtllm.sections import TrtllmDecodeWorkerConfig

    return TrtllmDecodeWorkerConfig


def engine_prefill_section(engine: str) -> type:
    """The PrefillWorker section model of ``engine`` (vllm, sglang or trtllm)."""
    if engine == "vllm":
        from splitserve.components.engines.vllm.sections import VllmPrefillWorkerConfig

        return VllmPrefillWorkerConfig
    if engine == "sglang":
        from splitserve.components.engines.sglang.sections import SglangPrefillWorkerConfig

        return SglangPrefillWorkerConfig
    from splitserve.components.engines.trtllm.sections import TrtllmPrefillWorkerConfig

    return TrtllmPrefillWorkerConfig


def make_engine(ctx: ComponentContext, cfg, role: str):
    """The section's engine object for ``role`` (decode or prefill), not started."""
    model, host = ctx.run.common.model, ctx.run.common.bind_host
    if cfg.engine == "vllm":
        from splitserve.components.engines.vllm.engine import VllmEngine

        # Only decode workers relay KV events to the router; a prefill engine's would
        # go nowhere.
        args = (cfg.engine_args if role == "decode"
                else cfg.engine_args.model_copy(update={"kv_events": False}))
        return VllmEngine(args, model, role, kv_transfer=cfg.kv_transfer)
    if cfg.engine == "sglang":
        from splitserve.components.engines.sglang.engine import SglangEngine

        return SglangEngine(cfg.engine_args, model, role, host=host,
                            advertise_host=ctx.run.common.advertised_host(),
                            replica=ctx.run.replica)
    if cfg.engine == "trtllm":
        from splitserve.components.engines.trtllm.engine import TrtllmEngine

        return TrtllmEngine(cfg.engine_args, model, role)
    raise ValueError(f"engine {cfg.engine!r} has no decode coordinator yet")


def coordinator_settings(cfg):
    """The coordinator's timings from a decode worker section (torch and mocker sections
    have no engine-cannot-prefill waits: their defaults apply)."""
    from .coordinator import CoordinatorSettings

    fields = {"remote_prefill_timeout_s": cfg.remote_prefill_timeout_s}
    if hasattr(cfg, "no_prefill_worker_wait_s"):
        fields["max_wait_for_prefill_worker_s"] = cfg.no_prefill_worker_wait_s
    if hasattr(cfg, "retry_after_s"):
        fields["retry_after_s"] = cfg.retry_after_s
    return CoordinatorSettings(**fields)


async def run_engine_decode_worker(ctx: ComponentContext, cfg) -> None:
    """Component main of every DecodeWorker: the engine, its decode coordinator, the
    prefill queue, the handoff subscription, load reports and policy updates."""
    from splitserve.common.connect import connect_nats
    from splitserve.components.disagg import build_decider
    from splitserve.components.mocker_worker.handoff import HandoffInbox, handoff_subject
    from splitserve.components.prefill_queue import PrefillQueue
    from splitserve.policy.component import follow_policy

    from .coordinator import EngineDecodeCoordinator
    from .engine_hosts import host_engine

    ns, component, nats_url = ctx.namespace, ctx.run.component, os.environ["NATS_SERVER"]
    decider = build_decider(cfg.disaggregated_router)
    async with contextlib.AsyncExitStack() as stack:
        h = await host_engine(ctx, cfg, "decode", stack)
        if h is None:
            return
        engine, worker_id, metrics = h.engine, h.worker_id, h.metrics
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="decode-worker")
        stack.push_async_callback(_bounded, queue.close)
        depth = queue.depth_monitor()
        await depth.start()
        stack.push_async_callback(_bounded, depth.stop)
        inbox = HandoffInbox()
        subject = handoff_subject(ns, component, worker_id)
        nc = await connect_nats(nats_url, name="decode-handoff")
        stack.push_async_callback(_bounded, nc.drain)
        await nc.subscribe(subject, cb=inbox.on_message)
        prefill_client = await ctx.endpoint("PrefillWorker", "generate").client()
        coord = EngineDecodeCoordinator(
            engine, decider, queue, inbox, subject, worker_id,
            live_prefill_workers=lambda: len(prefill_client.instance_ids()),
            queue_depth=lambda: depth.depth or 0, metrics=DisaggMetrics(metrics.registry),
            settings=coordinator_settings(cfg), requests=metrics.requests)

        def apply_policy(policy, version: int) -> None:
            if policy.disaggregated_router is not None:
                coord.decider = build_decider(policy.disaggregated_router)

        watcher = await follow_policy(ns, component, f"{worker_id:x}", apply_policy)
        stack.push_async_callback(_bounded, watcher.stop)
        tasks: list[asyncio.Task] = []
        stack.push_async_callback(_cancel_all, tasks)
        if not h.publishes_load:
            def sample() -> WorkerLoad:
                ld = engine.load()
                kv = (ld.kv_used_blocks, ld.kv_total_blocks) if h.report_kv else (0, 0)
                waiting = ld.waiting + inbox.waiting
                metrics.update(ld.active, waiting, *kv)
                return WorkerLoad(worker_id=worker_id, active=ld.active, waiting=waiting,
                                  kv_used_blocks=kv[0], kv_total_blocks=kv[1])

            reporter = asyncio.create_task(publish_load(
                nats_url, load_subject(ns, component), sample, cfg.load_report_interval_s,
                ctx.stopping, ReportFailures(metrics.load_report_failures)))
            tasks.append(reporter)
        tasks.append(asyncio.ensure_future(
            ctx.endpoint(component, "explain").serve_endpoint(coord.explain)))
        tasks.append(asyncio.create_task(report_ready_when_registered(
            ctx.report, h.endpoint, worker_id, endpoint=f"{ns}.{component.lower()}.generate",
            detail=f"instance {worker_id:x} ({engine.info.name}), handoff {subject}"
                   + (f", {h.detail}" if h.detail else ""), **h.ready_fields)))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, h.endpoint, coord.generate, drain_timeout_s=cfg.drain_timeout_s,
            inflight=lambda: coord.inflight))
        tasks.append(serving)
        await _serve_or_die(serving, h.died)
        if not h.publishes_load:
            await asyncio.wait({reporter}, timeout=5)  # its last report says "draining"


async def run_engine_prefill_worker(ctx: ComponentContext, cfg) -> None:
    """Component main of every PrefillWorker; exits non-zero when its pull loop fails or
    its engine dies."""
    from splitserve.common.connect import connect_nats
    from splitserve.components.prefill_queue import PrefillQueue

    from .engine_hosts import host_engine
    from .prefill_loop import PrefillLoopSettings, pull_loop

    ns, component, nats_url = ctx.namespace, ctx.run.component, os.environ["NATS_SERVER"]
    async with contextlib.AsyncExitStack() as stack:
        h = await host_engine(ctx, cfg, "prefill", stack)
        if h is None:
            return
        engine, worker_id = h.engine, h.worker_id
        settings = PrefillLoopSettings(
            max_concurrent_jobs=cfg.max_concurrent_jobs,
            heartbeat_s=cfg.prefill_queue.ack_wait_s / 3,
            handoff_timeout_s=getattr(cfg, "handoff_timeout_s", 5.0),
            prefill_timeout_s=getattr(cfg, "prefill_timeout_s", 120.0),
            drain_timeout_s=cfg.drain_timeout_s)
        metrics = PrefillMetrics(h.metrics.registry)
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="prefill-worker")
        stack.push_async_callback(_bounded, queue.close)
        nc = await connect_nats(nats_url, name="prefill-handoff")
        stack.push_async_callback(_bounded, nc.drain)
        tasks: list[asyncio.Task] = []
        stack.push_async_callback(_cancel_all, tasks)
        puller = asyncio.create_task(pull_loop(engine, nc, queue, settings, worker_id,
                                               metrics, ctx.stopping))
        tasks.append(puller)

        async def presence(request: dict, context=None):
            # Decode workers count live prefill workers by this endpoint's instances.
            yield {"ok": True, "engine": engine.info.name, "worker": f"{worker_id:x}"}

        tasks.append(asyncio.create_task(report_ready_when_registered(
            ctx.report, h.endpoint, worker_id, endpoint=f"{ns}.{component.lower()}.generate",
            detail=f"instance {worker_id:x} ({engine.info.name})"
                   + (f", {h.detail}" if h.detail else ""), **h.ready_fields)))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, h.endpoint, presence, drain_timeout_s=cfg.drain_timeout_s,
            inflight=engine.inflight))
        tasks.append(serving)
        await asyncio.wait({serving, puller, h.died}, return_when=asyncio.FIRST_COMPLETED)
        if h.died.done():
            raise h.died.result()
        if puller.done() and not ctx.stopping.is_set():
            puller.result()  # surface the pull loop's error
            raise RuntimeError("the pull loop ended while serving")
        await serving  # deregistered: nobody sends new work
        await asyncio.wait_for(puller, cfg.drain_timeout_s + 5)  # jobs in hand finish


async def _serve_or_die(serving: asyncio.Future, died: asyncio.Future) -> None:
    """Serve until stopped; an engine that dies first ends the replica with its error."""
    await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
    if died.done() and not serving.done():
        raise died.result()
    serving.result()


async def _bounded(close) -> None:
    try:
        await asyncio.wait_for(close(), 5)
    except Exception as exc:  # noqa: BLE001 - shutdown continues regardless
        log.warning("cleanup step failed: %s", exc)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
