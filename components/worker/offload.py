"""What a decode worker does with the decider's verdict when its engine may not prefill.

A decode-mode SGLang engine refuses requests without a bootstrap room: it cannot prefill
where it decodes.  So on such a worker the decider's "local" cannot be honoured: the
request goes remote, counted under ``engine-no-local-prefill``.  With no prefill worker
alive it waits a bounded time for one, then is refused with 503 and Retry-After — never
a hang, never a local prefill the engine would reject.  Engines that can prefill locally
(SGLang paired with a local aggregated engine, TensorRT-LLM, vLLM, torch) keep the
verdict and the coordinator's usual fallbacks.

Pure functions: the coordinator calls ``plan_offload`` per request (again after each
wait) and ``plan_after_remote_failure`` when a remote prefill failed or timed out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from splitserve.contracts import tracing

NO_LOCAL_PREFILL = "engine-no-local-prefill"
NO_PREFILL_WORKER = "no-prefill-worker"


@dataclass(frozen=True)
class OffloadPlan:
    """The coordinator's next step for one request.

    ``local`` / ``remote``: prefill there; ``wait``: sleep ``wait_s`` then call
    ``plan_offload`` again; ``reject``: answer 503 with ``Retry-After: retry_after_s``.
    """

    action: Literal["local", "remote", "wait", "reject"]
    reason: str
    wait_s: float = 0.0
    retry_after_s: float | None = None


def plan_offload(remote: bool, reason: str, *, supports_local_prefill: bool,
                 live_prefill_workers: int, waited_s: float, max_wait_s: float,
                 retry_after_s: float, poll_s: float = 0.1) -> OffloadPlan:
    """The step for a decider verdict (``remote``, ``reason``) on this worker.

    ``waited_s`` is how long this request already waited for a prefill worker.
    """
    if supports_local_prefill:
        return OffloadPlan("remote" if remote else "local", reason)
    if not remote:
        reason = NO_LOCAL_PREFILL
    if live_prefill_workers > 0:
        return OffloadPlan("remote", reason)
    if waited_s < max_wait_s:
        return OffloadPlan("wait", reason, wait_s=min(poll_s, max_wait_s - waited_s))
    return OffloadPlan("reject", NO_PREFILL_WORKER, retry_after_s=retry_after_s)


def plan_after_remote_failure(failure: str, *, supports_local_prefill: bool,
                              retry_after_s: float) -> OffloadPlan:
    """The step after a remote prefill failed (``failure``: timeout, queue-full, ...):
    a local prefill where the engine can, otherwise 503 with Retry-After."""
    if supports_local_prefill:
        return OffloadPlan("local", failure)
    return OffloadPlan("reject", failure, retry_after_s=retry_after_s)


def trace_offload(trace: Any, decision: Any, plan: OffloadPlan, waited_s: float,
                  prompt_tokens: int) -> None:
    """Record the offload decision as an ``offload`` span under the request's ``trace``
    (``contracts.tracing``): where the prompt is prefilled and why, the decider's own
    verdict, score and inputs, and how long it waited for a prefill worker."""
    if not trace:
        return
    now = tracing.now_ns()
    trace.record("offload", now - int(waited_s * 1e9), now, {
        "splitserve.offload.where": plan.action,
        "splitserve.offload.reason": plan.reason,
        "splitserve.offload.decider_remote": decision.remote,
        "splitserve.offload.decider_reason": decision.reason,
        "splitserve.offload.score": decision.score,
        "splitserve.offload.waited_s": waited_s or None,
        "splitserve.prompt_tokens": prompt_tokens,
        **{f"splitserve.offload.input.{k}": v for k, v in decision.contributions.items()}})


def end_remote_prefill(span: Any, got: Any) -> None:
    """End the decode side's ``remote_prefill`` span (enqueue to result) with the
    prefill worker's ``PrefillHandoff`` (None: no result came: queue refused, timeout,
    client gone)."""
    if not span:
        return
    if got is None:
        span.end({"splitserve.outcome": "no-result"}, error="no prefill result")
        return
    span.end({"splitserve.outcome": "refused" if got.refused else "done",
              "splitserve.prefill_worker_id": got.prefill_worker_id,
              "splitserve.prefill.compute_s": got.compute_s,
              "splitserve.kv.transfer_s": got.transfer_s},
             error=got.refused)
