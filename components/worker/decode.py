"""The decode shell: one DecodeWorker replica, for every engine.

``python -m splitserve.components.worker.decode_main`` runs it.  Around the hosted
engine it runs the decode coordinator (``coordinator.py``: the offload decider, remote
or local prefill), connects the prefill queue, takes prefill handoffs on this replica's
NATS subject (``handoff.py``), queues each job for the prefill worker holding its prefix
(``prefill_affinity``), follows policy updates, serves ``generate`` and
``explain`` on ``<ns>.decodeworker``, publishes load and reports ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from splitserve.contracts.kit.component import ComponentContext, serve_until_stopped

from . import registry
from splitserve.contracts.sections import DecodeTimings

from .coordinator import CoordinatorSettings, EngineDecodeCoordinator
from .disagg_metrics import DisaggMetrics
from .handoff import HandoffInbox, affinity_subject, handoff_subject
from .latency_metrics import TokenLatency, worker_labels
from .kv_moves import start_kv_moves
from .shell import (
    bounded,
    cancel_all,
    report_ready,
    serve_or_die,
    start_adapters,
    start_load_reports,
)

log = logging.getLogger("splitserve.worker")


def coordinator_settings(cfg) -> CoordinatorSettings:
    """The coordinator's timings from a decode worker section."""
    return CoordinatorSettings(**{name: getattr(cfg, name)
                                  for name in DecodeTimings.model_fields})


async def share_affinity(nc, coord: EngineDecodeCoordinator, subject: str, me: str) -> None:
    """Publish this decode worker's prefill placements on ``subject`` and remember the
    other decode workers' (``prefill_affinity.share``).  A lost message costs a prefix
    hit, nothing else: published without waiting, unreadable ones counted and dropped."""
    from splitserve.components.disagg import read_share, share_message

    affinity, metrics = coord.affinity, coord.metrics
    pending: set[asyncio.Task] = set()

    def published(task: asyncio.Task) -> None:
        pending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # closed at shutdown
            log.debug("a prefix affinity message was not sent: %s", task.exception())

    def share(worker: str, hashes) -> None:
        task = asyncio.ensure_future(nc.publish(subject, share_message(me, worker, hashes)))
        pending.add(task)
        task.add_done_callback(published)
        metrics.affinity_shared.labels("sent").inc()

    async def on_message(msg) -> None:
        try:
            origin, worker, hashes = read_share(msg.data)
        except ValueError as exc:
            metrics.affinity_shared.labels("unreadable").inc()
            log.debug("dropped a prefix affinity message: %s", exc)
            return
        if origin == me:
            return
        affinity.remember(worker, hashes)
        metrics.affinity_shared.labels("received").inc()

    await nc.subscribe(subject, cb=on_message)
    coord.share = share


async def run_decode(ctx: ComponentContext, cfg) -> None:
    """Component main of a DecodeWorker replica: the engine, its decode coordinator, the
    prefill queue, the handoff subscription, load reports and policy updates."""
    from splitserve.contracts.kit.connect import connect_nats
    from splitserve.components.disagg import PrefillAffinity, build_decider
    from splitserve.components.prefill_queue import PrefillQueue

    ns, component, nats_url = ctx.namespace, ctx.run.component, os.environ["NATS_SERVER"]
    decider = build_decider(cfg.disaggregated_router)
    async with contextlib.AsyncExitStack() as stack:
        h = await registry.host_engine(ctx, cfg, "decode", stack)
        if h is None:
            return
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.served_model_name,
                                           cfg.prefill_queue, client_name="decode-worker")
        stack.push_async_callback(bounded, queue.close)
        depth = queue.depth_monitor()
        await depth.start()
        stack.push_async_callback(bounded, depth.stop)
        inbox = HandoffInbox()
        subject = handoff_subject(ns, component, h.worker_id)
        nc = await connect_nats(nats_url, name="decode-handoff")
        stack.push_async_callback(bounded, nc.drain)
        await nc.subscribe(subject, cb=inbox.on_message)
        prefill_client = await ctx.endpoint("PrefillWorker", "generate").client()
        coord = EngineDecodeCoordinator(
            h.engine, decider, queue, inbox, subject, h.worker_id,
            live_prefill_workers=lambda: len(prefill_client.instance_ids()),
            queue_depth=lambda: depth.depth or 0, metrics=DisaggMetrics(h.metrics.registry),
            settings=coordinator_settings(cfg), requests=h.metrics.requests)
        coord.cut = ctx.drain_cut
        if cfg.prefill_affinity.enable:
            coord.affinity = PrefillAffinity(cfg.prefill_affinity)
            coord.live_prefill_ids = lambda: {f"{i:x}" for i in prefill_client.instance_ids()}
            coord.queued_by_worker = lambda: ((depth.last.by_worker, depth.last.measured_at)
                                              if depth.last else ({}, None))
            if cfg.prefill_affinity.share:
                await share_affinity(nc, coord, affinity_subject(ns, component),
                                     f"{h.worker_id:x}")
        coord.latency = TokenLatency(h.metrics.registry, *worker_labels(ctx.run))

        def apply_policy(policy, version: int) -> None:
            if policy.disaggregated_router is not None:
                coord.decider = build_decider(policy.disaggregated_router)

        watcher = await ctx.follow_policy(component, f"{h.worker_id:x}", apply_policy)
        if watcher is not None:
            stack.push_async_callback(bounded, watcher.stop)
        tasks: list[asyncio.Future] = []
        stack.push_async_callback(cancel_all, tasks)
        adapters = start_adapters(ctx, h, cfg, tasks)
        coord.prefill_serves = lambda name: adapters.prefill_serves(
            name, len(prefill_client.instance_ids()))
        reporter = start_load_reports(ctx, h, cfg.load_report_interval_s,
                                      extra_waiting=lambda: inbox.waiting,
                                      adapters=adapters)
        tasks += [reporter, asyncio.ensure_future(
            ctx.endpoint(component, "explain").serve_endpoint(coord.explain))]
        tasks.append(report_ready(ctx, h, extra=f"handoff {subject}"))
        coord.moves = await start_kv_moves(ctx, h.engine, h.metrics.registry, tasks)
        inflight = (lambda: coord.inflight) if coord.moves is None else (
            coord.moves.inflight(lambda: coord.inflight))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, h.endpoint, coord.generate, drain_timeout_s=cfg.drain_timeout_s,
            inflight=inflight))
        tasks.append(serving)
        await serve_or_die(serving, h.died)
        if coord.moves is not None:
            await coord.moves.wait_exported(cfg.kv_move_hold_s)
        await asyncio.wait({reporter}, timeout=5)  # its last report says "draining"
