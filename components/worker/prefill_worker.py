"""The prefill worker: pulls prefill jobs, computes the prompt's KV, writes it into the
decode worker's blocks over NIXL, and only then acknowledges the job.

A job is computed with the engine's own prefix cache (repeated prefixes are not
recomputed), as a prefill-only request whose blocks stay held until the transfer is
done.  Jobs past their deadline are dropped by the queue before they reach us; a job
whose transfer fails is handed back (nak) for another worker, or the decode worker's own
timeout turns it into a local prefill.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from splitserve.components.engines.torch_cpu import Request
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .disagg_config import PrefillWorkerConfig
from .disagg_metrics import PrefillMetrics
from .torch_worker import TorchWorker, start_torch_worker

log = logging.getLogger("splitserve.prefill")


async def prefill_one(w: TorchWorker, agent, job, metrics: PrefillMetrics,
                      heartbeat_s: float = 10.0) -> None:
    """Compute one job's KV, ship it, settle the job; never raises.

    ``heartbeat_s`` should be well under the queue's ack_wait (a third of it by default).
    """
    req = job.request
    eid = f"{req.request_id}@{job.delivery_count}"
    held = False
    try:
        q = w.runner.submit(Request(
            request_id=eid, prompt_token_ids=tuple(req.token_ids), max_tokens=1,
            temperature=req.temperature, top_p=req.top_p, seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids), prefill_only=True))
        t0 = asyncio.get_running_loop().time()
        while True:
            try:
                # Heartbeat while computing: a prefill longer than the queue's ack_wait
                # would otherwise be redelivered and computed (and written) twice.
                out = await asyncio.wait_for(q.get(), heartbeat_s)
            except TimeoutError:
                await job.in_progress()
                continue
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                break
        if out.finish_reason == "error":
            raise RuntimeError(out.error)
        held = out.finish_reason != "abort"
        metrics.compute.observe(asyncio.get_running_loop().time() - t0)
        skip = req.num_cached_tokens // req.block_size
        src = list(out.kv_block_ids[skip:skip + len(req.block_ids)])
        notify = json.dumps({"request_id": req.request_id,
                             "first_token": out.new_token_ids[0]}).encode()
        res = await agent.write_blocks(req.nixl_agent, src, req.block_ids, notify,
                                       request_id=req.request_id)
        metrics.transfer.observe(res.seconds)
        metrics.transfer_bytes.inc(res.nbytes)
        await job.ack()
        metrics.jobs.labels("done").inc()
    except Exception as exc:  # noqa: BLE001 - settle the job whatever happened
        log.warning("prefill of %s failed: %s", req.request_id, exc)
        metrics.jobs.labels("failed").inc()
        try:
            await job.nak(delay_s=0.1)
        except Exception as nak_exc:  # noqa: BLE001 - redelivery after ack_wait covers it
            log.debug("nak of %s failed: %s", req.request_id, nak_exc)
    finally:
        if held:
            await w.runner.call(w.core.release_kv, eid)


async def pull_loop(w: TorchWorker, agent, queue, cfg: PrefillWorkerConfig,
                    metrics: PrefillMetrics, stopping: asyncio.Event) -> None:
    """Keep up to ``max_concurrent_jobs`` jobs running until stopping."""
    running: set[asyncio.Task] = set()
    while not stopping.is_set():
        room = cfg.max_concurrent_jobs - len(running)
        if room <= 0:
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            continue
        for job in await queue.pull(batch=room, timeout=0.5):
            t = asyncio.create_task(prefill_one(w, agent, job, metrics,
                                                heartbeat_s=cfg.prefill_queue.ack_wait_s / 3))
            running.add(t)
            t.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running, timeout=cfg.drain_timeout_s)


async def run_prefill_worker(ctx: ComponentContext, cfg: PrefillWorkerConfig) -> None:
    """Component main of PrefillWorker."""
    from splitserve.components.kv_transfer import KvTransferAgent
    from splitserve.components.prefill_queue import PrefillQueue

    w = await start_torch_worker(ctx, cfg, publish_kv=False)
    ns = ctx.namespace
    metrics = PrefillMetrics(w.metrics.registry)
    queue = await PrefillQueue.connect(os.environ["NATS_SERVER"], ns, ctx.run.common.model,
                                       cfg.prefill_queue, client_name="prefill-worker")
    agent = KvTransferAgent(f"prefill-{w.worker_id:x}", w.core.kv_pool(),
                            etcd_endpoints=os.environ["ETCD_ENDPOINTS"],
                            config=cfg.kv_transfer.model_copy(update={"namespace": ns}))
    await agent.start()
    puller = asyncio.create_task(pull_loop(w, agent, queue, cfg, metrics, ctx.stopping))

    async def presence(request: dict, context=None):
        # Decode workers count live prefill workers by this endpoint's instances.
        yield {"ok": True, "agent": agent.name}

    ctx.report("ready", endpoint=f"{ns}.{ctx.run.component.lower()}.generate",
               detail=f"instance {w.worker_id:x}, agent {agent.name}")
    try:
        await serve_until_stopped(ctx, w.endpoint, presence,
                                  drain_timeout_s=cfg.drain_timeout_s, inflight=lambda: 0)
        await asyncio.wait_for(puller, cfg.drain_timeout_s + 5)
    finally:
        puller.cancel()
        await queue.close()
        await agent.close()
        await w.close()
