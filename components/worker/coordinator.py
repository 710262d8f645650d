"""The decode coordinator: one per decode worker replica, for every engine.

It reaches the engine only through ``splitserve.contracts.engine.Engine``, and the
optional members only where ``info.capabilities`` says they work (the prefix lookup;
reserving blocks for engines whose prefill side pushes KV: torch).  Per request:
the disaggregated router's decider gives a verdict (with this engine's prefix hit where
it can tell), ``plan_offload`` turns it into a step the engine can honour (a decode-mode
SGLang engine cannot prefill, so "local" becomes remote under ``engine-no-local-prefill``;
with no prefill worker alive such a request waits a bounded time, then is refused with
503 and Retry-After).

Remote: a prefill job is enqueued naming this replica's handoff subject (and, for torch,
the blocks reserved here first); the prefill worker sends a ``PrefillHandoff`` back there
over NATS request/reply, and ``engine.decode(request, handoff, first_token)`` streams
the tokens.  Local: ``engine.generate``.  A remote prefill that fails or times out is
planned again by ``plan_after_remote_failure`` (local prefill where the engine can, 503
where it cannot); a torch reservation that a late write could still reach is held until
that cannot happen.  Closing the stream (client gone) aborts in the engine; a request
still waiting for its handoff stops waiting and gives its reservation up, and the
prefill worker that finds nobody waiting settles the job without another delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence

from pydantic import Field, TypeAdapter

from splitserve.contracts import tracing
from splitserve.contracts.sections import DecodeTimings
from splitserve.components.disagg import (
    AffinityChoice,
    DisaggregatedRouter,
    OffloadDecision,
    OffloadRequest,
    OffloadSnapshot,
    PrefillAffinity,
)
from splitserve.contracts.engine import (
    Engine,
    EngineHandoff,
    GenerateParams,
    TokenDelta,
    TorchBlocksHandoff,
)
from splitserve.components.prefill_queue import EnqueueRejected, PrefillRequest
from splitserve.contracts.wire import FinishReason, WorkerRequest, output_chunk

from .cancel import until_stopped
from .kv_moves import DrainCut, KvMoves
from .disagg_metrics import DisaggMetrics
from .handoff import HandoffInbox
from .latency_metrics import TokenLatency
from .stall_guard import StallGuard
from .offload import (
    OffloadPlan,
    end_remote_prefill,
    plan_after_remote_failure,
    plan_offload,
    trace_offload,
)
from .wire import check_adapter, delta_chunk, params_from_wire

log = logging.getLogger("splitserve.coordinator")

HANDOFF_ADAPTER: TypeAdapter = TypeAdapter(EngineHandoff)
FORCED_LOCAL = DisaggregatedRouter.FORCED_LOCAL


class CoordinatorSettings(DecodeTimings):
    """Timings of the decode coordinator: the decode section's (declared once, in
    ``DecodeTimings``) and the re-check period while waiting, which is not a setting."""

    poll_s: float = Field(0.1, gt=0, description="Re-check period while waiting.")


class Rejected(Exception):
    """The request cannot be served now: answer 503 with ``Retry-After``."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


def job_carries(params: GenerateParams) -> bool:
    """True when a prefill job can sample the first token as this request asks: jobs carry
    the sampling (temperature, top-p, top-k, min-p, seed, penalties, bias) and the stop
    conditions, not a JSON schema or log-probabilities (such requests are prefilled
    where they decode)."""
    return (params.json_schema is None and params.logprobs is None
            and params.prompt_logprobs is None)


def check_adapter_prefill(params: GenerateParams, local_prefill: bool, engine: str,
                          prefill_serves: Callable[[str], bool]) -> None:
    """A request for a LoRA adapter is prefilled remotely only while every live prefill
    worker has the adapter loaded (``prefill_serves``), else where it decodes: refused
    (ValueError) on a decode engine that cannot prefill locally, whose prompt would
    otherwise be computed without the adapter."""
    if params.lora is not None and not local_prefill and not prefill_serves(params.lora):
        raise ValueError(f"the LoRA adapter '{params.lora}' cannot be served: the {engine} "
                         "decode engine cannot prefill locally, and not every live "
                         "prefill worker has the adapter loaded")


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """A finished remote prefill as the decode side receives it."""

    handoff: EngineHandoff | None
    first_token: int
    cached_tokens: int = 0
    finished: FinishReason | None = None
    """The request ended at ``first_token`` (EOS or a stop token): nothing to decode."""


def cached_tokens(got) -> int:
    """The prompt tokens a ``PrefillHandoff``'s prefill found in its engine's cache."""
    usage = got.completion_usage or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def read_result(rid: str, got) -> tuple[RemotePrefill | None, str]:
    """What a prefill worker's ``PrefillHandoff`` means for the waiting request: the
    result (its handoff None when the request ended at its first token), or (None,
    failure) when the engine refused the job or the handoff cannot be read."""
    if got.refused is not None:
        log.info("request %s: the prefill engine refused its job: %s", rid, got.refused)
        return None, "prefill-refused"
    cached = cached_tokens(got)
    if got.finish_reason is not None:
        return RemotePrefill(None, got.first_token, cached,
                             FinishReason(got.finish_reason)), ""
    try:
        handoff = HANDOFF_ADAPTER.validate_python(got.disaggregated_params)
    except ValueError as exc:
        log.warning("request %s: unreadable handoff: %s", rid, exc)
        return None, "bad-handoff"
    return RemotePrefill(handoff, got.first_token, cached), ""


class EngineDecodeCoordinator:
    """One decode worker replica's request handling around an ``Engine``.

    ``queue`` has ``async enqueue(PrefillRequest)``; ``live_prefill_workers`` and
    ``queue_depth`` are read just before each decision (no I/O); ``inbox`` receives the
    handoffs sent to ``subject``.
    """

    def __init__(self, engine: Engine, decider, queue, inbox: HandoffInbox, subject: str,
                 worker_id: int, *, live_prefill_workers: Callable[[], int],
                 queue_depth: Callable[[], int], metrics: DisaggMetrics,
                 settings: CoordinatorSettings, requests=None) -> None:
        self.engine, self.decider, self.queue, self.inbox = engine, decider, queue, inbox
        self.subject, self.worker_id = subject, worker_id
        self.live_prefill_workers, self.queue_depth = live_prefill_workers, queue_depth
        self.metrics, self.settings = metrics, settings
        self.requests = requests
        """Optional Counter labelled by outcome (the worker's requests_total)."""
        self.inflight = 0
        self.cut: asyncio.Event | None = None
        """The component's drain cut (``ComponentContext.drain_cut``): once set, requests
        still streaming end with a ``drained`` chunk and are resumed elsewhere."""
        self._engine_ids: dict[str, str] = {}  # request id -> engine's, where they differ
        self.prefill_serves: Callable[[str], bool] = lambda name: False
        """Whether every live prefill worker has LoRA adapter ``name`` loaded (the
        shell's ``AdapterSet.prefill_serves``): only then is a request for it offloaded."""
        self.moves: KvMoves | None = None
        """Live KV moves (``kv_moves.py``): the cut parks requests, and a request with a
        ``kv_source`` continues from that KV instead of being prefilled."""
        self.affinity: PrefillAffinity | None = None
        """Prefix affinity (``components/disagg/affinity.py``): queue a job for the live
        prefill worker holding its prefix; None: every job in the shared queue."""
        self.live_prefill_ids: Callable[[], Collection[str]] = lambda: ()
        """The live prefill workers' ids in hex (their presence instances)."""
        self.share: Callable[[str, Sequence[int]], None] = lambda worker, hashes: None
        """Tells the other decode workers that prefill worker ``worker`` holds (or is
        about to compute) these blocks (``prefill_affinity.share``; the shell publishes
        it); called at each placement and when a job comes back from another worker."""
        self.queued_by_worker: Callable[[], tuple[Mapping[str, int], float | None]] = (
            lambda: ({}, None))
        """Jobs in each prefill worker's own queue by the depth monitor's last reading,
        and when it was taken (``time.monotonic``; None: no reading)."""
        self.latency: TokenLatency | None = None
        """This worker's TTFT and ITL by pool and model (``latency_metrics.py``), timed
        per request from its arrival here; None: not timed."""
        self.guard = StallGuard(
            own_local_batch=engine.info.capabilities.local_prefill_own_batch)
        """The answers decoding here and the prefill speed: a local verdict whose prefill
        would stall one past the section's ``protect_tpot_ms`` goes remote
        (``stall_guard.py``)."""
        metrics.watch_guard(self.guard)

    async def _cached_prefix(self, token_ids: tuple[int, ...], lora: str | None = None) -> int:
        if not token_ids or not self.engine.info.capabilities.prefix_lookup:
            return 0
        return await self.engine.cached_prefix_tokens(token_ids, lora)

    def _count(self, outcome: str) -> None:
        if self.requests is not None:
            self.requests.labels(outcome).inc()

    def snapshot(self) -> OffloadSnapshot:
        """The decider's load inputs."""
        load = self.engine.load()
        usage = (load.kv_used_blocks / load.kv_total_blocks) if load.kv_total_blocks else 0.0
        return OffloadSnapshot(prefill_queue_depth=self.queue_depth(),
                               decode_active_requests=self.inflight,
                               decode_kv_usage=min(1.0, max(0.0, usage)),
                               live_prefill_workers=self.live_prefill_workers())

    async def explain(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The ``explain`` endpoint: the decider's verdict for ``token_ids`` (and
        ``lora``: a request for an adapter the prefill pool lacks prefills here) and the
        step this engine would take, without acting."""
        tokens = tuple(request.get("token_ids") or [])
        if tokens:
            self.engine.validate(GenerateParams(token_ids=tokens))
        req = OffloadRequest(request_id="explain", prompt_length=len(tokens),
                             prefix_cached_length=await self._cached_prefix(
                                 tokens, request.get("lora")),
                             priority=request.get("priority", "default"))
        snap = self.snapshot()
        lora = request.get("lora")
        if lora and not self.prefill_serves(lora):
            decision = OffloadDecision(remote=False, reason="lora-local-prefill")
        else:
            decision = self._guarded(self.decider.decide(req, snap), req.prefill_length)
        plan = plan_offload(decision.remote, decision.reason,
                            supports_local_prefill=self.engine.info.capabilities.local_prefill,
                            live_prefill_workers=snap.live_prefill_workers, waited_s=0.0,
                            max_wait_s=self.settings.no_prefill_worker_wait_s,
                            retry_after_s=self.settings.retry_after_s)
        out = {"worker_id": self.worker_id, "request": req.model_dump(),
               "snapshot": snap.model_dump(), "decision": decision.model_dump(),
               "plan": {"action": plan.action, "reason": plan.reason}}
        if self.affinity is not None and plan.action == "remote":
            queued, measured_at = self.queued_by_worker()
            choice = self.affinity.choose(self.affinity.hashes(tokens, lora), len(tokens),
                                          self.live_prefill_ids(), queued, measured_at)
            out["prefill_affinity"] = {"worker": choice.worker, "reason": choice.reason,
                                       "held_tokens": choice.held_tokens}
        yield out

    async def generate(self, request: dict, context=None) -> AsyncIterator[dict]:
        """The ``generate`` endpoint: output chunks; a refusal is one error chunk that
        carries ``retry_after_s`` (the frontend answers 503 with Retry-After)."""
        try:
            wreq = WorkerRequest.model_validate(request)
            params = params_from_wire(wreq)
            info = self.engine.info
            check_adapter(params, info)
            check_adapter_prefill(params, info.capabilities.local_prefill, info.name,
                                  self.prefill_serves)
            self.engine.validate(params)
        except Exception as exc:  # noqa: BLE001 - the client gets the reason
            self._count("rejected")
            yield output_chunk([], FinishReason.ERROR, error=f"request refused: {exc}")
            return
        meta = wreq.meta()
        rid = meta.request_id or uuid.uuid4().hex
        # This request's span on this worker, under the frontend's (Dynamo's context).
        trace = tracing.start("decode", tracing.from_dynamo(context), {
            "splitserve.request_id": rid, "splitserve.prompt_tokens": len(params.token_ids),
            "splitserve.worker_id": f"{self.worker_id:x}"}, kind="server"
        ) if tracing.enabled() else tracing.NOOP
        produced = 0
        outcome = FinishReason.CANCELLED.value
        moves = self.moves
        resumed = moves is not None and meta.kv_source is not None
        clock = self.latency.clock(first_token=not resumed) if self.latency else None
        if resumed:
            deltas = self._counted(moves.resume(rid, params, meta.kv_source, trace))
        else:
            deltas = self.serve(rid, params, meta.priority,
                                prefill_locally=meta.prefill_locally, trace=trace,
                                tpot_s=meta.tpot_ms / 1000.0 if meta.tpot_ms else None)
        drain = DrainCut(self.cut, moves, lambda: self._engine_ids.get(rid, rid),
                         len(params.token_ids))
        try:
            async with contextlib.aclosing(until_stopped(deltas, context, drain.stop)) as s:
                async for d in s:
                    produced += len(d.token_ids)
                    if clock is not None:
                        clock.tokens(len(d.token_ids))
                    if d.finished:
                        outcome = (d.finish_reason or FinishReason.EOS).value
                    yield delta_chunk(d, produced)
            if outcome == FinishReason.CANCELLED and drain.came:
                outcome = "drained"
                yield drain.drained_chunk(produced)
        except Rejected as exc:
            outcome = "rejected"
            chunk = output_chunk([], FinishReason.ERROR, error=f"overloaded: {exc.reason}")
            chunk["retry_after_s"] = exc.retry_after_s
            yield chunk
        except Exception as exc:  # noqa: BLE001 - the client gets an error chunk instead
            outcome = FinishReason.ERROR.value
            log.warning("request %s failed in the %s engine: %s", rid, self.engine.info.name,
                        exc)
            yield output_chunk([], FinishReason.ERROR,
                               error=f"{self.engine.info.name} engine: {exc}")
        finally:
            drain.close()
            self._count(outcome)
            trace.end({"splitserve.output_tokens": produced, "splitserve.outcome": outcome},
                      error=outcome if outcome in ("error", "rejected") else None)

    async def _counted(self, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
        """``deltas`` counted in flight (the drain and the decider see them)."""
        self.inflight += 1
        try:
            async for d in deltas:
                yield d
        finally:
            self.inflight -= 1
            await deltas.aclose()

    async def serve(self, rid: str, params: GenerateParams, priority: str = "default", *,
                    prefill_locally: bool = False, trace=tracing.NOOP,
                    tpot_s: float | None = None) -> AsyncIterator[TokenDelta]:
        """Decide, prefill (remotely or here) and stream the engine's deltas; raises
        ``Rejected`` when the request must be refused.  Closing it aborts the request.
        ``trace``: the request's span here (``contracts.tracing``); ``tpot_s``: its
        class's TPOT target, which the stall guard protects it to."""
        self.inflight += 1
        guard = self.guard
        try:
            plan, plan_cached = await self._plan(rid, params, priority, prefill_locally, trace)
            local_id = rid
            if plan.action == "remote":
                remote, failure = await self._remote_prefill(rid, params, trace)
                if remote is not None and remote.finished is not None:
                    yield TokenDelta(token_ids=(remote.first_token,), finished=True,
                                     finish_reason=remote.finished,
                                     prompt_tokens=len(params.token_ids),
                                     cached_tokens=remote.cached_tokens)
                    return
                if remote is not None:
                    guard.begin(rid, params.max_tokens, local=False, budget_s=tpot_s)
                    async with contextlib.aclosing(self.engine.decode(
                            rid, params, remote.handoff, first_token=remote.first_token)
                            ) as stream:
                        async for d in stream:
                            guard.token(rid, len(d.token_ids))
                            if d.finished and remote.cached_tokens > d.cached_tokens:
                                # The prefill worker's prefix hit is the one that saved work.
                                d = dataclasses.replace(d, cached_tokens=remote.cached_tokens)
                            yield d
                    return
                self.metrics.fallbacks.labels(failure).inc()
                log.info("request %s: remote prefill abandoned (%s)", rid, failure)
                plan = plan_after_remote_failure(
                    failure, supports_local_prefill=self.engine.info.capabilities.local_prefill,
                    retry_after_s=self.settings.retry_after_s)
                if plan.action == "reject":
                    raise Rejected(plan.reason, plan.retry_after_s or 0.0)
                local_id = f"{rid}#local"  # the remote id may still be held in the engine
                self._engine_ids[rid] = local_id
            guard.begin(rid, params.max_tokens, local=True,
                        prefill_tokens=len(params.token_ids) - plan_cached, budget_s=tpot_s)
            async with contextlib.aclosing(self.engine.generate(local_id, params)) as stream:
                async for d in stream:
                    guard.token(rid, len(d.token_ids))
                    yield d
        finally:
            self.inflight -= 1
            self._engine_ids.pop(rid, None)
            guard.end(rid)

    async def _plan(self, rid: str, params: GenerateParams, priority: str,
                    prefill_locally: bool, trace=tracing.NOOP) -> tuple[OffloadPlan, int]:
        """The step for this request, and the prompt tokens this engine's prefix cache
        holds (0 where it cannot tell, or where the decider was not asked)."""
        cached = 0
        if prefill_locally:
            # QoS degradation (low priority while the prefill pool is busy): no offload.
            decision = OffloadDecision(remote=False, reason="qos-local-prefill")
        elif params.lora is not None and not self.prefill_serves(params.lora):
            decision = OffloadDecision(remote=False, reason="lora-local-prefill")
        elif not job_carries(params):
            decision = OffloadDecision(remote=False, reason="sampling-local-prefill")
        else:
            cached = await self._cached_prefix(params.token_ids, params.lora)
            req = OffloadRequest(request_id=rid, prompt_length=len(params.token_ids),
                                 prefix_cached_length=cached, priority=priority)
            decision = self._guarded(self.decider.decide(req, self.snapshot()),
                                     req.prefill_length)
        waited = 0.0
        s = self.settings
        while True:
            plan = plan_offload(decision.remote, decision.reason,
                                supports_local_prefill=self.engine.info.capabilities.local_prefill,
                                live_prefill_workers=self.live_prefill_workers(),
                                waited_s=waited, max_wait_s=s.no_prefill_worker_wait_s,
                                retry_after_s=s.retry_after_s, poll_s=s.poll_s)
            if plan.action != "wait":
                break
            await asyncio.sleep(plan.wait_s)
            waited += plan.wait_s
        where = {"reject": "rejected"}.get(plan.action, plan.action)
        self.metrics.decisions.labels(where, plan.reason).inc()
        trace_offload(trace, decision, plan, waited, len(params.token_ids))
        if plan.action == "reject":
            log.info("request %s refused: %s (waited %.1fs)", rid, plan.reason, waited)
            raise Rejected(plan.reason, plan.retry_after_s or s.retry_after_s)
        return plan, cached

    def _guarded(self, decision: OffloadDecision, prefill_tokens: int) -> OffloadDecision:
        """The decider's verdict, or remote where its own local verdict (not a guard's:
        ``FORCED_LOCAL``) would stall an answer decoding here past its target: its class's
        or the section's ``protect_tpot_ms``, read from the decider at each decision (a
        policy reload changes it)."""
        if decision.remote or decision.reason in FORCED_LOCAL:
            return decision
        judged = self.guard.judge(prefill_tokens, getattr(self.decider, "protect_tpot_s", None))
        if judged.keep_local:
            return decision
        return OffloadDecision(remote=True, reason=judged.reason, score=decision.score,
                               contributions={**decision.contributions,
                                              "stall_ms": round(judged.stall_s * 1e3, 3),
                                              "answers_harmed": float(judged.harmed)})

    def _prefill_target(self, params: GenerateParams) -> tuple[AffinityChoice, list[int]]:
        """The prefill worker a job is queued for (prefix affinity), counted by reason;
        and the prompt's block hashes, remembered under whichever worker runs it."""
        if self.affinity is None:
            return AffinityChoice(None, "off"), []
        live = self.live_prefill_ids()
        self.affinity.forget_except(live)
        hashes = self.affinity.hashes(params.token_ids, params.lora)
        queued, measured_at = self.queued_by_worker()
        choice = self.affinity.choose(hashes, len(params.token_ids), live, queued,
                                      measured_at)
        if choice.worker is not None:
            choice = dataclasses.replace(choice, stamp=self.affinity.sent(choice.worker))
            self.affinity.remember(choice.worker, hashes)
            self.share(choice.worker, hashes)
        self.metrics.affinity.labels(choice.reason).inc()
        return choice, hashes

    async def _enqueue(self, job: PrefillRequest, target: str | None):
        if target is None:
            return await self.queue.enqueue(job)
        return await self.queue.enqueue(job, worker=target)

    def _prefill_ran(self, target: AffinityChoice, hashes: list[int], job: PrefillRequest,
                     got) -> None:
        """After a remote prefill's wait: the job queued for ``target.worker`` is settled,
        and a prompt a prefill worker computed is remembered under that worker; a
        finished prefill's speed teaches the stall guard."""
        if got is not None and got.refused is None and got.finish_reason is None:
            self.guard.observe_prefill(len(job.token_ids) - cached_tokens(got), got.compute_s)
        if self.affinity is None:
            return
        self.affinity.settled(target.worker, target.stamp)
        if got is not None and got.refused is None and got.prefill_worker_id:
            self.affinity.computed(got.prefill_worker_id, hashes,
                                   len(job.token_ids) - cached_tokens(got))
            if got.prefill_worker_id != target.worker:  # the placement was told already
                self.share(got.prefill_worker_id, hashes)

    async def _remote_prefill(self, rid: str, params: GenerateParams, trace=tracing.NOOP
                              ) -> tuple[RemotePrefill | None, str]:
        """Reserve (engines that are written into), enqueue the job and wait for the
        handoff; (result, "") or (None, failure).  The job carries the request's
        priority level: the queue serves it at that level and the prefill engine
        schedules it there."""
        timeout = self.settings.remote_prefill_timeout_s
        info = self.engine.info
        dest: TorchBlocksHandoff | None = None
        if info.capabilities.pushes_kv:
            dest = await self.engine.reserve_remote(rid, params)
            if dest is None:
                return None, "no-kv-room"
        settled = False  # True once the reservation was handed to decode() or released

        async def release(late_write_possible: bool) -> None:
            nonlocal settled
            if dest is not None and not settled:
                settled = True
                await self.engine.release_remote(rid, late_write_possible)

        try:
            try:
                job = PrefillRequest(
                    request_id=rid, priority=params.priority,
                    token_ids=list(params.token_ids),
                    decode_worker_id=f"{self.worker_id:x}", destination=dest,
                    num_cached_tokens=dest.num_cached_tokens if dest else 0,
                    enqueued_at=time.time(), max_wait_s=timeout,
                    temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                    stop_token_ids=list(params.stop_token_ids),
                    ignore_eos=params.ignore_eos, min_tokens=params.min_tokens,
                    top_k=params.top_k, min_p=params.min_p,
                    presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty,
                    repetition_penalty=params.repetition_penalty,
                    logit_bias=[list(pair) for pair in params.logit_bias],
                    lora=params.lora, handoff_subject=self.subject)
            except ValueError as exc:
                log.info("request %s cannot be offloaded (%s)", rid, str(exc).splitlines()[0])
                await release(False)
                return None, "invalid-job"
            target, hashes = self._prefill_target(params)
            waiting = self.inbox.expect(rid)  # before enqueue: a fast result must find it
            started = time.monotonic()
            # From enqueue to the prefill worker's result; the job carries its context.
            span = trace.child("remote_prefill", {"splitserve.prefill.tokens": len(
                job.token_ids) - job.num_cached_tokens} if trace else None,
                start_ns=int(job.enqueued_at * 1e9))
            got = None
            try:
                try:
                    with tracing.active(span):
                        enqueued = await self._enqueue(job, target.worker)
                except EnqueueRejected as exc:
                    await release(False)
                    return None, f"queue-{exc.reason}"
                if enqueued.duplicate:
                    # Not stored: an identical job is queued already, and its result
                    # would not be for this reservation. Waiting would only time out.
                    await release(False)
                    return None, "queue-duplicate"
                try:
                    got = await asyncio.wait_for(waiting, timeout)
                except TimeoutError:
                    await release(True)  # the job may still run and write late
                    return None, "timeout"
            finally:
                self.inbox.forget(rid)  # also when the client leaves while waiting
                end_remote_prefill(span, got)
                self._prefill_ran(target, hashes, job, got)
            self.metrics.remote_wait.observe(time.monotonic() - started)
            result, failure = read_result(rid, got)
            if result is None or result.handoff is None:
                # refused or unreadable (a late write is possible), or finished at its
                # first token (nothing comes): the reservation goes
                await release(result is None)
                return result, failure
            settled = True  # decode() takes the reservation over
            return result, ""
        finally:
            if not settled:  # cancelled while waiting (client gone, shutdown)
                try:
                    await asyncio.shield(release(True))
                except Exception as exc:  # noqa: BLE001 - cancelled already; log, go on
                    log.warning("request %s: releasing its reservation failed: %s", rid, exc)
