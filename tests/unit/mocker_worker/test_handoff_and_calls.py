"""Handoff messages and the pure request builders of the mocker disaggregated path."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.mocker_worker.calls import (
    decode_engine_request,
    kv_usage_estimate,
    prefill_engine_request,
    prefill_job,
    resumed_chunk,
)
from splitserve.components.mocker_worker.handoff import (
    HandoffInbox,
    PrefillHandoff,
    handoff_subject,
)
from splitserve.components.protocol import WorkerRequest

from .factories import request

pytestmark = pytest.mark.unit


def handoff(**over) -> PrefillHandoff:
    fields = {"request_id": "r1", "first_token": 5, "disaggregated_params": "dummy",
              "prefill_worker_id": "p1", "compute_s": 0.1, "transfer_s": 0.01}
    return PrefillHandoff.model_validate({**fields, **over})


def test_subject_is_per_decode_replica():
    assert handoff_subject("ns", "DecodeWorker", 0x1F) == "splitserve.ns.decodeworker.handoff.1f"


@pytest.mark.asyncio
async def test_inbox_accepts_only_what_a_request_is_waiting_for():
    inbox = HandoffInbox()
    fut = inbox.expect("r1")
    assert inbox.take(handoff().encode()).accepted
    assert (await asyncio.wait_for(fut, 1)).first_token == 5
    again = inbox.take(handoff().encode())  # redelivered job, request already resumed
    assert (again.accepted, again.reason) == (False, "not-waiting")
    inbox.expect("r2")
    inbox.forget("r2")  # timed out and went local
    assert inbox.take(handoff(request_id="r2").encode()).reason == "not-waiting"
    assert inbox.take(b"{not json").reason == "bad-message"
    assert inbox.waiting == 0


def test_prefill_job_carries_the_prompt_and_logical_blocks():
    wreq = WorkerRequest.model_validate(request(40))
    job = prefill_job(wreq, request_id="r1", priority="high", decode_worker_id=0xAB,
                      block_size=16, max_wait_s=3.0, handoff_subject="s.1")
    assert (job.block_ids, job.num_cached_tokens, job.handoff_subject) == ([0, 1, 2], 0, "s.1")
    assert (job.temperature, job.top_p, job.priority) == (0.0, 1.0, "high")
    assert job.nixl_agent == "mocker-ab" and job.deadline == job.enqueued_at + 3.0
    engine_req = prefill_engine_request(job, "m")
    assert engine_req["token_ids"] == wreq.token_ids
    assert engine_req["stop_conditions"] == {"max_tokens": 1}


def test_prefill_job_refuses_sampling_the_queue_cannot_express():
    wreq = WorkerRequest.model_validate(request(40))
    wreq.sampling_options.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        prefill_job(wreq, request_id="r1", priority="default", decode_worker_id=1,
                    block_size=16, max_wait_s=3.0, handoff_subject="s.1")


def test_decode_request_resumes_the_original_with_one_token_less():
    original = request(40, max_tokens=9)
    resumed = decode_engine_request(original, handoff(), 8)
    assert resumed["stop_conditions"]["max_tokens"] == 8
    assert resumed["prefill_result"] == {"disaggregated_params": "dummy"}
    assert resumed["extra_args"] == original["extra_args"]
    assert original["stop_conditions"]["max_tokens"] == 9 and "prefill_result" not in original


@pytest.mark.parametrize(("chunk", "expected_usage"), [
    ({"token_ids": [3]}, None),
    ({"token_ids": [3], "completion_usage": {
        "prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 0}}},
     {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
      "prompt_tokens_details": {"cached_tokens": 32}}),
])
def test_resumed_chunks_count_the_prefill_token_and_its_cache_hit(chunk, expected_usage):
    h = handoff(completion_usage={"prompt_tokens": 40, "completion_tokens": 1,
                                  "prompt_tokens_details": {"cached_tokens": 32}})
    assert resumed_chunk(chunk, h).get("completion_usage") == expected_usage


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, 0.0), (16, 1 / 100), (17, 2 / 100), (16 * 100, 1.0), (10**9, 1.0)])
def test_kv_usage_estimate(tokens, expected):
    assert kv_usage_estimate(tokens, 16, 100) == pytest.approx(expected)
