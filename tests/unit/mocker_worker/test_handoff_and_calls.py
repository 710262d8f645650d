"""Handoff messages, jobs and engine requests of the mocker disaggregated path."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.engines.mocker.adapter import engine_request, kv_usage_estimate
from splitserve.components.worker.handoff import (
    HandoffInbox,
    PrefillHandoff,
    handoff_subject,
)
from splitserve.contracts.wire import WorkerRequest
from splitserve.components.worker.wire import params_from_wire

from .factories import collect, coordinator, request

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


@pytest.mark.asyncio
async def test_prefill_job_carries_the_prompt_and_no_blocks():
    # The mocker moves no KV memory: its job names no destination blocks (version 1 made
    # it invent logical blocks and an agent name).
    coord, _, queue = coordinator()
    await collect(coord, request(400, max_tokens=2))
    (job,) = queue.jobs
    assert len(job.token_ids) == 400 and job.num_cached_tokens == 0
    assert job.destination is None and job.handoff_subject is not None
    assert job.deadline == job.enqueued_at + 0.2


def test_engine_requests_map_the_parameters_and_the_handoff():
    params = params_from_wire(WorkerRequest.model_validate(request(40, max_tokens=9)))
    req = engine_request("m", "r1", params)
    assert req["token_ids"] == list(params.token_ids) and req["eos_token_ids"] == [2]
    assert req["stop_conditions"] == {"max_tokens": 9, "ignore_eos": False}
    assert "prefill_result" not in req
    resumed = engine_request("m", "r1", params, max_tokens=8, handoff="dummy")
    assert resumed["stop_conditions"]["max_tokens"] == 8
    assert resumed["prefill_result"] == {"disaggregated_params": "dummy"}
    assert resumed["extra_args"] == {"splitserve": {"request_id": "r1"}}


@pytest.mark.parametrize(("tokens", "expected"), [
    (0, 0.0), (16, 1 / 100), (17, 2 / 100), (16 * 100, 1.0), (10**9, 1.0)])
def test_kv_usage_estimate(tokens, expected):
    assert kv_usage_estimate(tokens, 16, 100) == pytest.approx(expected)
