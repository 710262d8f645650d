"""DecodeWorker with ``engine: mocker``: our decider and prefill queue around two mockers.

The wrapper serves ``<ns>.decodeworker.generate`` itself, so the router and frontend
address it like a torch decode worker.  Per request it asks the decider (load: its own
in-flight requests, the queue depth from the depth monitor, live PrefillWorker
instances).  Remote: enqueue a ``PrefillRequest`` naming this replica's handoff subject,
wait for the prefill result, stream the first token, then resume on the decode-mode
engine with ``prefill_result``.  Local: the aggregated engine prefills and decodes (a
decode-mode mocker skips prefill compute, so it cannot stand in for a local prefill).
Fallbacks (queue full or unavailable, timeout) and their metrics match the torch path.
"""

from __future__ import annotations

import asyncio
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
from splitserve.components.protocol import (
    RequestMeta,
    WorkerLoad,
    WorkerRequest,
    load_subject,
    output_chunk,
)
from splitserve.components.worker.disagg_metrics import DisaggMetrics
from splitserve.components.worker.loadreport import publish_load
from splitserve.components.worker.readiness import report_ready_when_registered
from splitserve.components.worker.metrics import WorkerMetrics
from splitserve.serve.component import ComponentContext, serve_until_stopped

from .calls import (
    decode_engine_request,
    first_token_chunk,
    kv_usage_estimate,
    prefill_job,
    resumed_chunk,
)
from .disagg_config import MockerDecodeWorkerConfig
from .engines import EngineChild, first_exit, start_engines, stop_engines
from .handoff import HandoffInbox, PrefillHandoff, handoff_subject

log = logging.getLogger("splitserve.mocker_disagg")

ROLES = {"decode": "decode", "local": "agg"}  # role -> the mocker's --disaggregation-mode


class MockerDecodeCoordinator:
    """Per-request choice between local and remote prefill, and the handoff protocol."""

    def __init__(self, cfg: MockerDecodeWorkerConfig, engines: dict[str, EngineChild],
                 worker_id: int, subject: str, decider, queue, depth, prefill_client,
                 inbox: HandoffInbox, metrics: WorkerMetrics) -> None:
        self.cfg = cfg
        self.engines = engines
        self.worker_id = worker_id
        self.subject = subject
        self.decider = decider
        self.queue = queue
        self.depth = depth
        self.prefill_client = prefill_client
        self.inbox = inbox
        self.metrics = metrics
        self.disagg = DisaggMetrics(metrics.registry)
        self.inflight = 0
        self.tokens_in_flight = 0

    def snapshot(self) -> OffloadSnapshot:
        """The decider's load inputs, read without I/O just before each decision."""
        args = self.cfg.engine_args
        return OffloadSnapshot(
            prefill_queue_depth=self.depth.depth or 0,
            decode_active_requests=self.inflight,
            decode_kv_usage=kv_usage_estimate(self.tokens_in_flight, args.block_size,
                                              args.num_gpu_blocks),
            live_prefill_workers=len(self.prefill_client.instance_ids()))

    def load(self) -> WorkerLoad:
        """This replica's load report for routers (no KV figures: the engines keep them)."""
        self.metrics.update(self.inflight, self.inbox.waiting, 0, 0)
        return WorkerLoad(worker_id=self.worker_id, active=self.inflight,
                          waiting=self.inbox.waiting)

    async def explain(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The `explain` endpoint: the offload decision for ``token_ids``, without acting
        (same answer shape as the torch decode worker's; used by `dynamo route explain`)."""
        req = OffloadRequest(request_id="explain",
                             prompt_length=len(request.get("token_ids") or []),
                             priority=request.get("priority", "default"))
        snap = self.snapshot()
        decision = self.decider.decide(req, snap)
        yield {"worker_id": self.worker_id, "request": req.model_dump(),
               "snapshot": snap.model_dump(), "decision": decision.model_dump()}

    async def generate(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The `generate` endpoint handler: decide, prefill (here or remotely), stream."""
        try:
            wreq = WorkerRequest.model_validate(request)
            max_tokens = wreq.stop_conditions.max_tokens
            if not wreq.token_ids or not max_tokens or max_tokens < 1:
                raise ValueError("token_ids and max_tokens >= 1 are required by the mocker")
        except Exception as exc:  # noqa: BLE001
            self.metrics.requests.labels("rejected").inc()
            yield output_chunk([], "error", error=f"request refused: {exc}")
            return
        meta = wreq.meta()
        rid = meta.request_id or uuid.uuid4().hex
        cost = len(wreq.token_ids) + max_tokens
        self.inflight += 1
        self.tokens_in_flight += cost
        try:
            async for chunk in self._serve(request, wreq, rid, meta, max_tokens):
                yield chunk
        finally:
            self.inflight -= 1
            self.tokens_in_flight -= cost

    async def _serve(self, request: dict, wreq: WorkerRequest, rid: str, meta: RequestMeta,
                     max_tokens: int) -> AsyncIterator[dict]:
        if meta.prefill_locally:
            # QoS degradation (low priority while the prefill pool is busy): no offload.
            decision = OffloadDecision(remote=False, reason="qos-local-prefill")
        else:
            decision = self.decider.decide(
                OffloadRequest(request_id=rid, prompt_length=len(wreq.token_ids),
                               priority=meta.priority), self.snapshot())
        self.disagg.decisions.labels("remote" if decision.remote else "local",
                                     decision.reason).inc()
        handoff = await self._remote_prefill(wreq, rid, meta.priority) if decision.remote \
            else None
        if handoff is None:
            async for chunk in self._engine(self.engines["local"], request):
                yield chunk
            return
        yield first_token_chunk(handoff)
        if max_tokens == 1:
            self.metrics.requests.labels("length").inc()
            yield output_chunk([], "length")
            return
        resumed = decode_engine_request(request, handoff, max_tokens - 1)
        async for chunk in self._engine(self.engines["decode"], resumed):
            yield resumed_chunk(chunk, handoff)

    async def _engine(self, engine: EngineChild, request: dict) -> AsyncIterator[dict]:
        finish = "cancelled"
        try:
            async for chunk in engine.stream(request, self.cfg.engine_idle_timeout_s):
                finish = chunk.get("finish_reason") or finish
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the client gets an error chunk instead
            finish = "error"
            log.warning("%s engine failed: %s", engine.role, exc)
            yield output_chunk([], "error", error=f"{engine.role} engine: {exc}")
        finally:
            self.metrics.requests.labels(finish).inc()

    async def _remote_prefill(self, wreq: WorkerRequest, rid: str, priority: str
                              ) -> PrefillHandoff | None:
        """Enqueue, wait for the prefill result; the handoff, or None to go local."""
        from splitserve.components.prefill_queue import EnqueueRejected

        cfg = self.cfg
        try:
            job = prefill_job(wreq, request_id=rid, priority=priority,
                              decode_worker_id=self.worker_id,
                              block_size=cfg.engine_args.block_size,
                              max_wait_s=cfg.remote_prefill_timeout_s,
                              handoff_subject=self.subject)
        except ValueError as exc:
            log.info("request %s cannot be offloaded (%s)", rid, str(exc).splitlines()[0])
            return self._give_up(rid, "invalid-job")
        waiting = self.inbox.expect(rid)  # before enqueue: a fast result must find it
        started = time.monotonic()
        try:
            await self.queue.enqueue(job)
        except EnqueueRejected as exc:
            return self._give_up(rid, f"queue-{exc.reason}")
        try:
            handoff = await asyncio.wait_for(waiting, cfg.remote_prefill_timeout_s)
        except TimeoutError:
            return self._give_up(rid, "timeout")
        finally:
            self.inbox.forget(rid)  # also when this request is cancelled while waiting
        self.disagg.remote_wait.observe(time.monotonic() - started)
        return handoff

    def _give_up(self, rid: str, reason: str) -> None:
        self.inbox.forget(rid)
        self.disagg.fallbacks.labels(reason).inc()
        log.info("request %s: remote prefill abandoned (%s); prefilling locally", rid, reason)


async def run_mocker_decode_worker(ctx: ComponentContext, cfg: MockerDecodeWorkerConfig
                                   ) -> None:
    """Component main of DecodeWorker with ``engine: mocker``; exits non-zero if an
    engine dies (the supervisor then restarts the replica)."""
    from splitserve.common.connect import connect_nats
    from splitserve.components.prefill_queue import PrefillQueue

    decider = build_decider(cfg.disaggregated_router)
    children = await start_engines(ctx, cfg.engine_args, ROLES)
    if children is None:
        return
    ns, component = ctx.namespace, ctx.run.component
    cleanup: list = []
    reporter: asyncio.Task | None = None
    try:
        endpoint = ctx.endpoint(component, "generate")
        worker_id = endpoint.connection_id()
        queue = await PrefillQueue.connect(os.environ["NATS_SERVER"], ns, ctx.run.common.model,
                                           cfg.prefill_queue, client_name="mocker-decode")
        cleanup.append(queue.close)
        depth = queue.depth_monitor()
        await depth.start()
        cleanup.append(depth.stop)
        inbox = HandoffInbox()
        subject = handoff_subject(ns, component, worker_id)
        nc = await connect_nats(os.environ["NATS_SERVER"], name="mocker-decode-handoff")
        cleanup.append(nc.drain)
        await nc.subscribe(subject, cb=inbox.on_message)
        prefill_client = await ctx.endpoint("PrefillWorker", "generate").client()
        metrics = WorkerMetrics()
        ctx.serve_metrics(metrics.registry)
        coord = MockerDecodeCoordinator(cfg, {c.role: c for c in children}, worker_id,
                                        subject, decider, queue, depth, prefill_client,
                                        inbox, metrics)
        reporter = asyncio.create_task(publish_load(
            os.environ["NATS_SERVER"], load_subject(ns, component), coord.load,
            cfg.load_report_interval_s, ctx.stopping))
        explaining = asyncio.ensure_future(
            ctx.endpoint(component, "explain").serve_endpoint(coord.explain))
        cleanup.append(lambda: _cancelled(explaining))
        ready = asyncio.ensure_future(report_ready_when_registered(
            ctx.report, endpoint, worker_id, endpoint=f"{ns}.{component.lower()}.generate",
            instance_id=worker_id, engine_pids=[c.proc.pid for c in children],
            detail=f"instance {worker_id:x}, handoff {subject}"))
        cleanup.append(lambda: _cancelled(ready))
        serving = asyncio.ensure_future(serve_until_stopped(
            ctx, endpoint, coord.generate, drain_timeout_s=cfg.drain_timeout_s,
            inflight=lambda: coord.inflight))
        died = asyncio.ensure_future(first_exit(children))
        await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            serving.cancel()
            raise died.result()
        died.cancel()
        serving.result()
        await asyncio.wait_for(reporter, 5)  # its last report says "draining"
    finally:
        if reporter is not None and not reporter.done():
            reporter.cancel()
        for close in reversed(cleanup):
            try:
                await asyncio.wait_for(close(), 5)
            except Exception as exc:  # noqa: BLE001 - shutdown continues regardless
                log.warning("cleanup step failed: %s", exc)
        await stop_engines(children, cfg.engine_args.stop_timeout_s)


async def _cancelled(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
