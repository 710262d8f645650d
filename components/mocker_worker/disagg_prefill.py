"""PrefillWorker with ``engine: mocker``: pulls our prefill jobs, runs them on a
prefill-mode mocker, hands each result to the decode worker, then acks.

The engine answers a job with one token (carrying ``disaggregated_params``) when the
simulated prefill is done, and ends its stream after the simulated KV transfer
(prompt tokens x KV bytes per token / ``kv_transfer_bandwidth``), so the handoff leaves
when the KV would have arrived.  The wrapper serves a presence endpoint on
``<ns>.prefillworker.generate``: decode workers count live prefill workers by it.
"""

from __future__ import annotations

import asyncio
import logging
import os

from prometheus_client import CollectorRegistry

from splitserve.components.worker.disagg_metrics import PrefillMetrics
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .calls import prefill_engine_request
from .disagg_config import MockerPrefillWorkerConfig
from .engines import EngineChild, first_exit, start_engines, stop_engines
from .handoff import PrefillHandoff, hand_over

log = logging.getLogger("splitserve.mocker_disagg")

ROLES = {"prefill": "prefill"}


async def run_engine(engine: EngineChild, request: dict, idle_timeout_s: float
                     ) -> tuple[dict, float, float]:
    """Run one prefill on the engine; returns (token chunk, compute s, transfer s)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first: dict | None = None
    t_first = t0
    async for chunk in engine.stream(request, idle_timeout_s):
        if chunk.get("finish_reason") == "error" or chunk.get("error"):
            raise RuntimeError(f"prefill engine error: {chunk}")
        if first is None and chunk.get("token_ids"):
            first, t_first = chunk, loop.time()
    if first is None:
        raise RuntimeError("prefill engine ended without a token")
    return first, t_first - t0, loop.time() - t_first


async def keep_alive(job, every_s: float) -> None:
    """Push the job's redelivery deadline back while a long simulated prefill (or a slow
    simulated transfer) runs, so the queue does not hand it to a second worker."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await job.in_progress()
        except Exception as exc:  # noqa: BLE001 - at worst the job is redelivered
            log.debug("in_progress for %s failed: %s", job.request.request_id, exc)


async def prefill_one(engine: EngineChild, nc, job, cfg: MockerPrefillWorkerConfig,
                      model: str, worker_id: int, metrics: PrefillMetrics) -> None:
    """Prefill one job, hand the result over, settle the job; never raises."""
    import nats.errors

    req = job.request
    outcome = "done"
    try:
        if req.handoff_subject is None:
            # A job from a decode worker that waits for a NIXL write we cannot make.
            await job.term("no-handoff-subject")
            outcome = "unservable"
            return
        heartbeat = asyncio.create_task(keep_alive(job, cfg.prefill_queue.ack_wait_s / 3))
        try:
            first, compute_s, transfer_s = await run_engine(
                engine, prefill_engine_request(req, model), cfg.engine_idle_timeout_s)
        finally:
            heartbeat.cancel()
        metrics.compute.observe(compute_s)
        metrics.transfer.observe(transfer_s)
        handoff = PrefillHandoff(
            request_id=req.request_id, first_token=first["token_ids"][0],
            disaggregated_params=first.get("disaggregated_params"),
            completion_usage=first.get("completion_usage"),
            prefill_worker_id=f"{worker_id:x}", compute_s=compute_s, transfer_s=transfer_s)
        try:
            reply = await hand_over(nc, req.handoff_subject, handoff, cfg.handoff_timeout_s)
        except nats.errors.NoRespondersError:
            await job.term("decode-gone")  # that decode worker replica no longer exists
            outcome = "decode-gone"
            return
        # Acked after any reply: a decode worker that stopped waiting has prefilled
        # locally, and another delivery would only repeat the work.
        await job.ack()
        outcome = "done" if reply.accepted else "orphaned"
    except Exception as exc:  # noqa: BLE001 - settle the job whatever happened
        log.warning("prefill of %s failed: %s", req.request_id, exc)
        outcome = "failed"
        try:
            await job.nak(delay_s=0.1)
        except Exception as nak_exc:  # noqa: BLE001 - redelivery after ack_wait covers it
            log.debug("nak of %s failed: %s", req.request_id, nak_exc)
    finally:
        metrics.jobs.labels(outcome).inc()


async def pull_loop(engine: EngineChild, nc, queue, cfg: MockerPrefillWorkerConfig, model: str,
                    worker_id: int, metrics: PrefillMetrics,
                    stopping: asyncio.Event) -> None:
    """Keep up to ``max_concurrent_jobs`` jobs running until stopping, then drain."""
    running: set[asyncio.Task] = set()
    while not stopping.is_set():
        room = cfg.max_concurrent_jobs - len(running)
        if room <= 0:
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            continue
        for job in await queue.pull(batch=room, timeout=0.5):
            t = asyncio.create_task(prefill_one(engine, nc, job, cfg, model, worker_id,
                                                metrics))
            running.add(t)
            t.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running, timeout=cfg.drain_timeout_s)


async def run_mocker_prefill_worker(ctx: ComponentContext, cfg: MockerPrefillWorkerConfig
                                    ) -> None:
    """Component main of PrefillWorker with ``engine: mocker``; exits non-zero if its
    engine dies."""
    from splitserve.common.connect import connect_nats
    from splitserve.components.prefill_queue import PrefillQueue

    children = await start_engines(ctx, cfg.engine_args, ROLES)
    if children is None:
        return
    ns, component = ctx.namespace, ctx.run.component
    queue = nc = puller = None
    try:
        endpoint = ctx.endpoint(component, "generate")
        worker_id = endpoint.connection_id()
        metrics = PrefillMetrics(CollectorRegistry())
        ctx.serve_metrics(metrics.registry)
        queue = await PrefillQueue.connect(os.environ["NATS_SERVER"], ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="mocker-prefill")
        nc = await connect_nats(os.environ["NATS_SERVER"], name="mocker-prefill-handoff")
        puller = asyncio.create_task(pull_loop(children[0], nc, queue, cfg,
                                               ctx.run.common.model, worker_id, metrics,
                                               ctx.stopping))

        async def presence(request: dict, context=None):
            # Decode workers count live prefill workers by this endpoint's instances.
            yield {"ok": True, "engine": "mocker", "worker": f"{worker_id:x}"}

        ctx.report("ready", endpoint=f"{ns}.{component.lower()}.generate",
                   instance_id=worker_id, engine_pids=[c.proc.pid for c in children],
                   detail=f"instance {worker_id:x}")
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, endpoint, presence, drain_timeout_s=cfg.drain_timeout_s, inflight=lambda: 0))
        died = asyncio.ensure_future(first_exit(children))
        await asyncio.wait({serving, died, puller}, return_when=asyncio.FIRST_COMPLETED)
        if died.done() or (puller.done() and not ctx.stopping.is_set()):
            serving.cancel()
            if died.done():
                raise died.result()
            died.cancel()
            puller.result()  # the pull loop failed: surface its error
            raise RuntimeError("the pull loop ended while serving")
        died.cancel()
        # Stopping: the pull loop may end before deregistration has finished; wait for it.
        await serving
        # Deregistered: finish the jobs in hand (the engine is still up) before stopping it.
        await asyncio.wait_for(puller, cfg.drain_timeout_s + 5)
    finally:
        if puller is not None:
            puller.cancel()
        for closing in ((queue.close() if queue else None), (nc.drain() if nc else None)):
            if closing is not None:
                try:
                    await asyncio.wait_for(closing, 5)
                except Exception as exc:  # noqa: BLE001 - shutdown continues regardless
                    log.warning("cleanup step failed: %s", exc)
        await stop_engines(children, cfg.engine_args.stop_timeout_s)
