"""The prefill shell: one PrefillWorker replica, for every engine.

``python -m splitserve.components.worker.prefill_main`` runs it.  Around the hosted
engine it runs the prefill loop (``prefill_loop.py``: pull a job, prefill, hand the
result to the decode worker, ack), loads the namespace's LoRA adapters (a job names the
adapter its prompt is computed with) and serves a presence endpoint on
``<ns>.prefillworker.generate``, by which decode workers count live prefill workers;
its load gauges are what the planner reads for the prefill pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from splitserve.contracts.kit.component import ComponentContext, serve_until_stopped

from . import registry
from .disagg_metrics import PrefillMetrics
from .latency_metrics import worker_labels
from splitserve.contracts.sections import Draining, PrefillTimings

from .prefill_loop import PrefillLoopSettings, pull_loop
from .shell import bounded, cancel_all, report_ready, start_adapters, start_load_reports


def loop_settings(cfg) -> PrefillLoopSettings:
    """The prefill loop's timings from a prefill worker section."""
    declared = {**PrefillTimings.model_fields, **Draining.model_fields}
    return PrefillLoopSettings(heartbeat_s=cfg.prefill_queue.ack_wait_s / 3,
                               **{name: getattr(cfg, name) for name in declared})


async def run_prefill(ctx: ComponentContext, cfg) -> None:
    """Component main of a PrefillWorker replica; exits non-zero when its pull loop
    fails or its engine dies."""
    from splitserve.contracts.kit.connect import connect_nats
    from splitserve.components.prefill_queue import PrefillQueue

    ns, nats_url = ctx.namespace, os.environ["NATS_SERVER"]
    async with contextlib.AsyncExitStack() as stack:
        h = await registry.host_engine(ctx, cfg, "prefill", stack)
        if h is None:
            return
        engine, worker_id = h.engine, h.worker_id
        # Its own consumers take the jobs decode workers queue for it (prefix affinity).
        queue = await PrefillQueue.connect(nats_url, ns, ctx.run.common.served_model_name,
                                           cfg.prefill_queue, client_name="prefill-worker",
                                           worker=f"{worker_id:x}")
        stack.push_async_callback(bounded, queue.close)
        nc = await connect_nats(nats_url, name="prefill-handoff")
        stack.push_async_callback(bounded, nc.drain)
        tasks: list[asyncio.Future] = []
        stack.push_async_callback(cancel_all, tasks)
        metrics = PrefillMetrics(h.metrics.registry, *worker_labels(ctx.run))
        puller = asyncio.create_task(pull_loop(engine, nc, queue, loop_settings(cfg),
                                               worker_id, metrics, ctx.stopping))
        tasks.append(puller)

        async def presence(request: dict, context=None):
            # Decode workers count live prefill workers by this endpoint's instances.
            yield {"ok": True, "engine": engine.info.name, "worker": f"{worker_id:x}"}

        adapters = start_adapters(ctx, h, cfg, tasks, role="prefill")
        reporter = start_load_reports(ctx, h, cfg.load_report_interval_s,
                                      adapters=adapters)
        tasks += [reporter, report_ready(ctx, h)]
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
        await asyncio.wait({reporter}, timeout=5)  # its last report says "draining"
