"""The prefill loop: one per prefill worker replica, for every engine.

It reaches the engine only through ``splitserve.contracts.engine.Engine`` (SGLang's
``begin_prefill`` where ``info.capabilities.handoff_before_prefill`` says the handoff
exists before the prefill runs).  Per job, the engine request id is
``<request id>@<enqueue>.<delivery>`` (``engine_request_id``) so neither a redelivered
job nor a later job of the same request (resumed on, or resent to, another decode
worker) collides with an earlier attempt still held in the engine, which would refuse
it as a duplicate id:

- handoff first (SGLang): ``begin_prefill`` -> send the bootstrap handoff to the decode
  worker at once (it must join the room before the prefill computes) -> await the
  result -> ack;
- result first (torch, mocker, vLLM, TensorRT-LLM): ``prefill()`` -> send the result to
  the waiting decode worker -> ack.  Engines that push KV (``pushes_kv``: torch)
  are given the job's destination blocks and have written them before ``prefill``
  returns.

An engine that refuses the job itself (``ValueError``: its parameters are invalid for
this engine) fails the same way on every delivery: the job is terminated at once and
the decode worker told (a ``PrefillHandoff`` with ``refused``), so it prefills the
request itself without waiting out its timeout.

The handoff travels as a ``PrefillHandoff`` NATS request/reply on the job's
``handoff_subject``.  Long jobs are heartbeated; failures nak (redelivery); a decode
worker that is gone terminates the job; one that stopped waiting gets the job acked
(another delivery would only repeat the work) and, for SGLang, the begun prefill
aborted (nobody will join its room).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

from pydantic import Field

from splitserve.contracts import tracing
from splitserve.contracts.sections import Draining, PrefillTimings
from splitserve.contracts.engine import (
    Engine,
    GenerateParams,
)
from splitserve.components.prefill_queue import PrefillRequest

from .disagg_metrics import PrefillMetrics
from .handoff import PrefillHandoff, hand_over

log = logging.getLogger("splitserve.prefill_loop")


class PrefillLoopSettings(PrefillTimings, Draining):
    """Timings of the prefill loop: the prefill section's (declared once, in
    ``PrefillTimings`` and ``Draining``) and the heartbeat, which the shell derives from
    the queue's ``ack_wait_s``."""

    heartbeat_s: float = Field(10.0, gt=0, description="in_progress period during a job "
                               "(keep it well under the queue's ack_wait_s).")


async def keep_alive(job, every_s: float) -> None:
    """Push the job's redelivery deadline back while a long prefill (or transfer) runs,
    so the queue does not hand it to a second worker."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await job.in_progress()
        except Exception as exc:  # noqa: BLE001 - at worst the job is redelivered
            log.debug("in_progress for %s failed: %s", job.request.request_id, exc)


def engine_request_id(req: PrefillRequest, delivery: int) -> str:
    """The prefill engine's id for one delivery of one job: the request id, a tag of the
    enqueue (its ``dedup_key``) and the delivery count.  Everything after the last ``@``
    is this worker's own (the torch engine names the request without it to the decode
    side)."""
    return f"{req.request_id}@{zlib.crc32(req.dedup_key().encode()):08x}.{delivery}"


def job_params(req: PrefillRequest) -> GenerateParams:
    """The engine's view of a job: the prompt, one token, the request's sampling (its
    cuts, penalties and bias included), priority level and LoRA adapter.  Of the request's ``min_tokens`` the job keeps what
    applies to its one token (at most 1: that token must not be a stop token); more
    than ``max_tokens`` is invalid for vLLM and SGLang, which refuse it."""
    return GenerateParams(token_ids=tuple(req.token_ids), max_tokens=1,
                          temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                          stop_token_ids=tuple(req.stop_token_ids),
                          ignore_eos=req.ignore_eos, min_tokens=min(req.min_tokens, 1),
                          priority=req.level(), lora=req.lora, top_k=req.top_k,
                          min_p=req.min_p, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty,
                          logit_bias=tuple((int(t), float(b)) for t, b in req.logit_bias))


def observe(metrics: PrefillMetrics, result, prompt_tokens: int = 0) -> dict | None:
    """Count a finished prefill's compute, transfer and prompt tokens (those found in
    this engine's prefix cache apart); its usage for the handoff (the prefix hit here,
    which the decode side reports)."""
    metrics.computed(result.compute_s)
    metrics.prompt_tokens.labels("prompt").inc(prompt_tokens)
    metrics.prompt_tokens.labels("cached").inc(min(result.cached_tokens, prompt_tokens))
    if result.transfer_bytes or result.transfer_s:
        metrics.transferred(result.transfer_s, result.transfer_bytes)
    if result.cached_tokens:
        return {"prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
    return None


def unservable(req: PrefillRequest, pushes_kv: bool) -> str:
    """Why a job waits for a transfer this engine cannot make ("" when it can): no
    subject to hand over on, or no blocks to write into (a decode engine that does not
    take pushes)."""
    if req.handoff_subject is None:
        return "no-handoff-subject"
    return "no-destination" if pushes_kv and req.destination is None else ""


async def prefill_one(engine: Engine, nc, job, settings: PrefillLoopSettings,
                      worker_id: int, metrics: PrefillMetrics) -> str:
    """Prefill one job, hand it over, settle the job; returns the outcome, never raises."""
    import nats.errors

    req = job.request
    rid = req.request_id
    eid = engine_request_id(req, getattr(job, "delivery_count", 1))
    outcome = "done"
    metrics.latency.picked_up(req.enqueued_at)
    metrics.taken.labels(getattr(job, "source", "shared")).inc()
    trace = job_span(job)
    heartbeat = asyncio.create_task(keep_alive(job, settings.heartbeat_s))
    pending = None
    try:
        caps = engine.info.capabilities
        why = unservable(req, caps.pushes_kv)
        if why:
            await job.term(why)
            outcome = "unservable"
            return outcome
        t0 = time.monotonic()
        params = job_params(req)
        transfer_s, usage, finished = 0.0, None, None
        if caps.handoff_before_prefill:
            ticket = await engine.begin_prefill(eid, params)
            pending = ticket.result
            first_token, handoff = 0, ticket.handoff  # the decode engine streams token 1
        else:
            kwargs = {"destination": req.destination} if caps.pushes_kv else {}
            result = await asyncio.wait_for(engine.prefill(eid, params, **kwargs),
                                            settings.prefill_timeout_s)
            first_token, handoff = result.first_token, result.handoff
            transfer_s = result.transfer_s
            finished = result.finished.value if result.finished is not None else None
            usage = observe(metrics, result, len(req.token_ids))
            trace_prefill(trace, t0, result)
        message = PrefillHandoff(
            request_id=rid, first_token=first_token,
            disaggregated_params=None if handoff is None else handoff.model_dump(mode="json"),
            finish_reason=finished, completion_usage=usage,
            prefill_worker_id=f"{worker_id:x}",
            compute_s=max(0.0, time.monotonic() - t0 - transfer_s), transfer_s=transfer_s)
        try:
            reply = await hand_over(nc, req.handoff_subject, message,
                                    settings.handoff_timeout_s)
        except nats.errors.NoRespondersError:
            await job.term("decode-gone")
            outcome = "decode-gone"
            return outcome
        if not reply.accepted:
            # The decode worker stopped waiting (timeout, fallback, client gone): another
            # delivery would only repeat the work.
            await job.ack()
            outcome = "orphaned"
            return outcome
        if pending is not None:
            result = await asyncio.wait_for(pending, settings.prefill_timeout_s)
            pending = None
            metrics.computed(result.compute_s)
            trace_prefill(trace, t0, result)
        await job.ack()
        return outcome
    except ValueError as exc:  # the engine refused the job: no delivery can succeed
        log.warning("prefill of %s refused by the %s engine: %s", rid, engine.info.name, exc)
        outcome = "refused"
        await refuse(job, nc, worker_id, f"{engine.info.name}: {exc}", settings)
        return outcome
    except Exception as exc:  # noqa: BLE001 - settle the job whatever happened
        log.warning("prefill of %s failed: %s", rid, exc)
        outcome = "failed"
        try:
            await job.nak(delay_s=0.1)
        except Exception as nak_exc:  # noqa: BLE001 - redelivery after ack_wait covers it
            log.debug("nak of %s failed: %s", rid, nak_exc)
        return outcome
    finally:
        heartbeat.cancel()
        if pending is not None:  # begun and not finished: nobody will take its KV
            pending.cancel()
            try:
                await engine.abort(eid)
            except Exception as exc:  # noqa: BLE001 - the engine frees it on its own timeout
                log.warning("abort of %s after its job ended failed: %s", eid, exc)
        metrics.jobs.labels(outcome).inc()
        trace.end({"splitserve.outcome": outcome},
                  error=None if outcome in ("done", "orphaned") else outcome)


def job_span(job) -> tracing.Span | tracing.NoopSpan:
    """The job's ``prefill`` span, under the decode worker's ``remote_prefill`` (the
    message's headers), after a ``prefill_queue_wait`` span from its enqueue to now."""
    if not tracing.enabled():
        return tracing.NOOP
    req = job.request
    parent = getattr(job, "headers", None) or {}
    now = tracing.now_ns()
    tracing.record("prefill_queue_wait", parent, min(now, int(req.enqueued_at * 1e9)), now, {
        "splitserve.request_id": req.request_id, "splitserve.queue.level":
        getattr(job, "level", None), "splitserve.queue.delivery":
        getattr(job, "delivery_count", None)})
    return tracing.start("prefill", parent, {
        "splitserve.request_id": req.request_id,
        "splitserve.prompt_tokens": len(req.token_ids),
        "splitserve.prefill.tokens": req.tokens_to_prefill},
        kind="consumer", start_ns=now)


def trace_prefill(trace, t0: float, result) -> None:
    """``prefill_compute`` and ``kv_transfer`` spans under the job's, from the engine's
    result (its compute and transfer times; the transfer follows the compute)."""
    if not trace:
        return
    begin = tracing.wall_ns(t0)
    computed = begin + int(result.compute_s * 1e9)
    trace.record("prefill_compute", begin, computed, {
        "splitserve.cached_tokens": result.cached_tokens,
        "splitserve.prefill.compute_s": result.compute_s})
    if result.transfer_s or result.transfer_bytes:
        s = result.transfer_s
        trace.record("kv_transfer", computed, computed + int(s * 1e9), {
            "splitserve.kv.bytes": result.transfer_bytes, "splitserve.kv.transfer_s": s,
            "splitserve.kv.gbps": result.transfer_bytes * 8 / s / 1e9 if s else None})


async def refuse(job, nc, worker_id: int, why: str, settings: PrefillLoopSettings) -> None:
    """Terminate a job its engine refused and tell the waiting decode worker (best
    effort: a decode worker that does not hear it falls back at its timeout)."""
    req = job.request
    if req.handoff_subject is not None:
        message = PrefillHandoff(request_id=req.request_id, first_token=0,
                                 prefill_worker_id=f"{worker_id:x}", compute_s=0.0,
                                 transfer_s=0.0, refused=why[:500])
        try:
            await hand_over(nc, req.handoff_subject, message, settings.handoff_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the decode worker's timeout covers it
            log.debug("telling %s of its refusal failed: %s", req.request_id, exc)
    try:
        await job.term("refused")
    except Exception as exc:  # noqa: BLE001 - at worst it is redelivered
        log.debug("term of %s failed: %s", req.request_id, exc)


async def pull_loop(engine: Engine, nc, queue, settings: PrefillLoopSettings, worker_id: int,
                    metrics: PrefillMetrics, stopping: asyncio.Event) -> None:
    """Keep up to ``max_concurrent_jobs`` jobs, and while they hold fewer than
    ``max_inflight_tokens`` uncached prompt tokens, running until ``stopping``; then
    drain.  With a token bound jobs are pulled one at a time: what a worker cannot start
    computing soon stays in the shared queue for whichever worker frees up first."""
    running: dict[asyncio.Task, int] = {}
    budget = settings.max_inflight_tokens
    while not stopping.is_set():
        room = settings.max_concurrent_jobs - len(running)
        if room <= 0 or (budget and sum(running.values()) >= budget):
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            continue
        for job in await queue.pull(batch=1 if budget else room, wait_s=0.5):
            t = asyncio.create_task(prefill_one(engine, nc, job, settings, worker_id,
                                                metrics))
            running[t] = job.request.tokens_to_prefill
            t.add_done_callback(lambda done: running.pop(done, None))
    if running:
        await asyncio.wait(running, timeout=settings.drain_timeout_s)
