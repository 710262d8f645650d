"""The decode worker: runs the disaggregated router per request, decodes everything.

For each new request: look up this worker's prefix hit, read the prefill-queue depth
(cached by a background monitor) and its own load, and ask the decider.  Remote: reserve
the prompt's KV blocks here, enqueue a prefill job naming them, keep decoding other
requests, and resume this one when the prefill worker's KV write is announced.  Any
problem on the way (no room, queue full, no prefill worker, timeout) falls back to a local
prefill, counted by reason.  A remote allocation abandoned on timeout stays reserved until
the job's deadline has passed, because a late KV write could still land in its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from splitserve.components.disagg import (
    OffloadDecision,
    OffloadRequest,
    OffloadSnapshot,
    build_decider,
)
from splitserve.components.protocol import WorkerRequest, output_chunk
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .disagg_config import DecodeWorkerConfig
from .disagg_metrics import DisaggMetrics
from .readiness import report_ready_when_registered
from .torch_worker import TorchWorker, engine_request, start_torch_worker, stream_outputs

log = logging.getLogger("splitserve.decode")


class DecodeCoordinator:
    """Per-request choice between local and remote prefill, and the remote protocol."""

    def __init__(self, w: TorchWorker, cfg: DecodeWorkerConfig, decider, queue, depth,
                 agent, prefill_client, namespace: str) -> None:
        self.w = w
        self.cfg = cfg
        self.decider = decider
        self.queue = queue
        self.depth = depth
        self.agent = agent
        self.prefill_client = prefill_client
        self.namespace = namespace
        self.metrics = DisaggMetrics(w.metrics.registry)
        self.block_size = cfg.engine_args.block_size
        self._quarantine: set[asyncio.Task] = set()

    def snapshot(self) -> OffloadSnapshot:
        st = self.w.runner.last_stats or self.w.core.stats()
        return OffloadSnapshot(
            prefill_queue_depth=self.depth.depth or 0,
            decode_active_requests=st.num_running + st.num_waiting,
            decode_kv_usage=min(1.0, st.kv_blocks_used / max(1, st.kv_blocks_total)),
            live_prefill_workers=len(self.prefill_client.instance_ids()))

    async def explain(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The `explain` endpoint: the offload decision for ``token_ids``, without acting.

        Used by `dynamo route explain` after the router picked this worker.
        """
        tokens = list(request.get("token_ids") or [])
        self.w.core.check_token_ids(tokens, "explain")
        cached = await self.w.runner.call(self.w.core.cached_prefix_tokens, tokens) \
            if tokens else 0
        req = OffloadRequest(request_id="explain", prompt_length=len(tokens),
                             prefix_cached_length=cached,
                             priority=request.get("priority", "default"))
        snap = self.snapshot()
        decision = self.decider.decide(req, snap)
        yield {"worker_id": self.w.worker_id, "request": req.model_dump(),
               "snapshot": snap.model_dump(), "decision": decision.model_dump()}

    async def generate(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The `generate` endpoint handler."""
        try:
            wreq = WorkerRequest.model_validate(request)
            meta = wreq.meta()
            rid = meta.request_id or uuid.uuid4().hex
            ereq = engine_request(wreq, rid)
            self.w.core.check_token_ids(ereq.prompt_token_ids, rid)
        except Exception as exc:  # noqa: BLE001
            self.w.metrics.requests.labels("rejected").inc()
            yield output_chunk([], "error", error=f"request refused: {exc}")
            return
        runner = self.w.runner
        if meta.prefill_locally:
            # QoS degradation (low priority while the prefill pool is busy): no offload.
            decision = OffloadDecision(remote=False, reason="qos-local-prefill")
        else:
            cached = await runner.call(self.w.core.cached_prefix_tokens, ereq.prompt_token_ids)
            decision = self.decider.decide(
                OffloadRequest(request_id=rid, prompt_length=len(ereq.prompt_token_ids),
                               prefix_cached_length=cached, priority=meta.priority),
                self.snapshot())
        where = "remote" if decision.remote else "local"
        self.metrics.decisions.labels(where, decision.reason).inc()
        if decision.remote:
            q = await self._remote_prefill(ereq, meta.priority)
            if q is not None:
                async for chunk in stream_outputs(runner, q, rid, self.w.metrics, context):
                    yield chunk
                return
            ereq = engine_request(wreq, f"{rid}#local")  # the remote id may be quarantined
        try:
            q = runner.submit(ereq)
        except Exception as exc:  # noqa: BLE001
            yield output_chunk([], "error", error=f"request refused: {exc}")
            return
        async for chunk in stream_outputs(runner, q, ereq.request_id, self.w.metrics, context):
            yield chunk

    async def _remote_prefill(self, ereq, class_name: str):
        """Reserve blocks, enqueue, wait for the KV; the output queue, or None to go local.

        The job carries the priority class by name: the queue serves its levels (high,
        default, low) highest first, so high priority jumps queued low-priority prefills.
        """
        from splitserve.components.kv_transfer.errors import TransferError
        from splitserve.components.prefill_queue import EnqueueRejected, PrefillRequest

        runner, core, rid = self.w.runner, self.w.core, ereq.request_id
        q = runner.open_stream(rid)
        alloc = await runner.call(core.allocate_remote, ereq)
        if alloc is None:
            return self._give_up(rid, "no-kv-room", abort=False)
        skip = alloc.num_cached_tokens // self.block_size
        job = PrefillRequest(
            request_id=rid, priority=class_name, token_ids=list(ereq.prompt_token_ids),
            num_cached_tokens=skip * self.block_size, decode_worker_id=f"{self.w.worker_id:x}",
            nixl_agent=self.agent.name, block_ids=list(alloc.block_ids[skip:]),
            block_size=self.block_size, enqueued_at=time.time(),
            max_wait_s=self.cfg.remote_prefill_timeout_s, temperature=ereq.temperature,
            top_p=ereq.top_p, seed=ereq.seed, stop_token_ids=list(ereq.stop_token_ids))
        started = time.monotonic()
        try:
            await self.queue.enqueue(job)
        except EnqueueRejected as exc:
            return self._give_up(rid, f"queue-{exc.reason}", abort=True)
        try:
            arrival = await self.agent.wait_for(rid, self.cfg.remote_prefill_timeout_s)
        except TransferError:
            # A late write may still land in these blocks: keep them reserved until the
            # job's deadline (plus a margin) has passed, then release them.
            self._quarantine_allocation(rid, self.cfg.remote_prefill_timeout_s + 5.0)
            return self._give_up(rid, "timeout", abort=False)
        self.metrics.remote_wait.observe(time.monotonic() - started)
        first = json.loads(arrival.payload)["first_token"]
        await runner.call(core.resume_remote, rid, first)
        return q

    def _give_up(self, rid: str, reason: str, abort: bool) -> None:
        self.metrics.fallbacks.labels(reason).inc()
        self.w.runner.streams.pop(rid, None)
        if abort:
            self.w.runner.commands.put(("abort", rid))
        log.info("request %s: remote prefill abandoned (%s); prefilling locally", rid, reason)
        return None

    def _quarantine_allocation(self, rid: str, hold_s: float) -> None:
        async def release_later() -> None:
            await asyncio.sleep(hold_s)
            self.w.runner.commands.put(("abort", rid))

        task = asyncio.ensure_future(release_later())
        self._quarantine.add(task)
        task.add_done_callback(self._quarantine.discard)


async def run_decode_worker(ctx: ComponentContext, cfg: DecodeWorkerConfig) -> None:
    """Component main of DecodeWorker."""
    from splitserve.components.kv_transfer import KvTransferAgent
    from splitserve.components.prefill_queue import PrefillQueue

    decider = build_decider(cfg.disaggregated_router)
    w = await start_torch_worker(ctx, cfg)
    ns = ctx.namespace
    queue = await PrefillQueue.connect(os.environ["NATS_SERVER"], ns, ctx.run.common.model,
                                       cfg.prefill_queue, client_name="decode-worker")
    depth = queue.depth_monitor()
    await depth.start()
    agent = KvTransferAgent(f"decode-{w.worker_id:x}", w.core.kv_pool(),
                            etcd_endpoints=os.environ["ETCD_ENDPOINTS"],
                            config=cfg.kv_transfer.model_copy(update={"namespace": ns}))
    await agent.start()
    agent.start_poller()
    prefill_client = await ctx.endpoint("PrefillWorker", "generate").client()
    coord = DecodeCoordinator(w, cfg, decider, queue, depth, agent, prefill_client, ns)
    def apply_policy(policy, version: int) -> None:
        if policy.disaggregated_router is not None:
            coord.decider = build_decider(policy.disaggregated_router)

    from splitserve.policy.component import follow_policy

    watcher = await follow_policy(ns, ctx.run.component, f"{w.worker_id:x}", apply_policy)
    explain_ep = ctx.endpoint(ctx.run.component, "explain")
    explaining = asyncio.ensure_future(explain_ep.serve_endpoint(coord.explain))
    ready = asyncio.create_task(report_ready_when_registered(
        ctx.report, w.endpoint, w.worker_id,
        endpoint=f"{ns}.{ctx.run.component.lower()}.generate",
        detail=f"instance {w.worker_id:x}, agent {agent.name}"))
    try:
        await serve_until_stopped(ctx, w.endpoint, coord.generate,
                                  drain_timeout_s=cfg.drain_timeout_s, inflight=w.runner.inflight)
    finally:
        ready.cancel()
        await watcher.stop()
        explaining.cancel()
        await depth.stop()
        await queue.close()
        await agent.close()
        await w.close()
