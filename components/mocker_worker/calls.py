"""Pure builders for the mocker disaggregated path: engine requests, jobs, chunks.

No I/O here, so unit tests cover the exact dicts the engines and the queue receive.
"""

from __future__ import annotations

import math
import time
from typing import Any

from splitserve.components.prefill_queue import PrefillRequest
from splitserve.components.protocol import WorkerRequest, output_chunk

from .handoff import PrefillHandoff


def prefill_job(wreq: WorkerRequest, *, request_id: str, priority: str, decode_worker_id: int,
                block_size: int, max_wait_s: float, handoff_subject: str) -> PrefillRequest:
    """The job a mocker decode worker enqueues for one request (raises ValueError if the
    request cannot be expressed as a job, e.g. top_p = 0).

    No KV memory exists in a mocker fleet: ``block_ids`` are the logical blocks the
    prompt occupies and ``nixl_agent`` only names the decode worker.
    """
    s = wreq.sampling_options
    return PrefillRequest(
        request_id=request_id, priority=priority, token_ids=list(wreq.token_ids),
        decode_worker_id=f"{decode_worker_id:x}", nixl_agent=f"mocker-{decode_worker_id:x}",
        block_ids=list(range(math.ceil(len(wreq.token_ids) / block_size))),
        block_size=block_size, enqueued_at=time.time(), max_wait_s=max_wait_s,
        temperature=s.temperature if s.temperature is not None else 0.0,
        top_p=s.top_p if s.top_p is not None else 1.0, seed=s.seed,
        handoff_subject=handoff_subject)


def prefill_engine_request(job: PrefillRequest, model: str) -> dict[str, Any]:
    """What the prefill worker sends its prefill-mode engine for one job.

    ``max_tokens`` 1: a prefill-mode mocker answers one token (carrying
    ``disaggregated_params``) and then, after the simulated KV transfer, the end.
    """
    return {
        "model": model, "token_ids": list(job.token_ids),
        "stop_conditions": {"max_tokens": 1},
        "sampling_options": {"temperature": job.temperature, "top_p": job.top_p,
                             "seed": job.seed},
        "eos_token_ids": [], "annotations": [],
        "extra_args": {"splitserve": {"request_id": job.request_id}},
    }


def decode_engine_request(request: dict[str, Any], handoff: PrefillHandoff, remaining: int
                          ) -> dict[str, Any]:
    """The original request, resumed on the decode-mode engine after a remote prefill:
    ``remaining`` = max_tokens - 1 (the prefill worker produced the first token)."""
    stop = dict(request.get("stop_conditions") or {})
    stop["max_tokens"] = remaining
    return {**request, "stop_conditions": stop,
            "prefill_result": {"disaggregated_params": handoff.disaggregated_params}}


def first_token_chunk(handoff: PrefillHandoff) -> dict[str, Any]:
    """The chunk the decode worker streams for the prefill worker's first token."""
    chunk = output_chunk([handoff.first_token])
    if handoff.completion_usage:
        chunk["completion_usage"] = handoff.completion_usage
    return chunk


def resumed_chunk(chunk: dict[str, Any], handoff: PrefillHandoff) -> dict[str, Any]:
    """A decode-engine chunk with its usage counted from the request's start: one more
    completion token (the first came from the prefill worker) and the prefill worker's
    prompt details (its prefix hit is the one that saved work)."""
    usage = chunk.get("completion_usage")
    if not isinstance(usage, dict):
        return chunk
    usage = {**usage, "completion_tokens": (usage.get("completion_tokens") or 0) + 1,
             "total_tokens": (usage.get("total_tokens") or 0) + 1}
    prefill_details = (handoff.completion_usage or {}).get("prompt_tokens_details")
    if prefill_details is not None:
        usage["prompt_tokens_details"] = prefill_details
    return {**chunk, "completion_usage": usage}


def kv_usage_estimate(tokens_in_flight: int, block_size: int, num_blocks: int) -> float:
    """The decider's ``decode_kv_usage`` for a mocker decode worker, whose engines do not
    report KV use to us: blocks the in-flight requests need (prompt + max_tokens, at
    most) over one engine's capacity, clamped to [0, 1]."""
    return min(1.0, math.ceil(tokens_in_flight / block_size) / num_blocks)
