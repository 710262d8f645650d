"""The wire model, its versioning, triage of received payloads and priority levels."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from splitserve.components.prefill_queue import (
    PrefillQueueConfig,
    PrefillRequest,
    priority_level,
    triage,
)

from .factories import make_request, request_fields, version_1_fields

pytestmark = pytest.mark.unit


def test_round_trip_through_json() -> None:
    req = make_request(priority="high", num_cached_tokens=16, block_ids=[5, 6])
    verdict = triage(req.encode(), now=1000.5)
    assert verdict.verdict == "ok" and verdict.request == req


def test_retired_trace_fields_parse_as_null_are_not_written_and_refuse_a_value() -> None:
    import json

    req = make_request()
    assert "trace_id" not in json.loads(req.encode())
    old = {**json.loads(req.encode()), "trace_id": None, "parent_span_id": None}
    assert triage(json.dumps(old).encode(), now=1000.5).verdict == "ok"
    with pytest.raises(ValueError, match="trace_id"):
        make_request(trace_id="t1")


def test_deadline_comes_from_max_wait() -> None:
    assert make_request(enqueued_at=10.0, max_wait_s=2.5).deadline == 12.5
    assert make_request(max_wait_s=None).deadline is None


@pytest.mark.parametrize("over, message", [
    ({"block_ids": [1]}, "cannot hold"),  # 40 tokens, one 16-token block
    ({"num_cached_tokens": 40}, "nothing to prefill"),
    ({"priority": -1}, "level index"),
    ({"priority": 1.5}, "priority"),
    ({"token_ids": []}, "token_ids"),
    ({"block_ids": [-1, 2, 3]}, ">= 0"),
    ({"block_size": 0}, "block_size"),
    ({"destination": {"nixl_agent": "a", "block_ids": [4, 5, 6], "block_size": 16,
                      "num_cached_tokens": 16}}, "differs from num_cached_tokens"),
    ({"version": 3}, "version"),
    ({"surprise": True}, "surprise"),
    ({"max_wait_s": 0}, "max_wait_s"),
])
def test_invalid_requests_are_rejected(over: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PrefillRequest.model_validate(request_fields(**over))


@pytest.mark.parametrize("payload, now, verdict", [
    (None, 1001.0, "ok"),                       # 1 s into a 2 s wait
    (None, 1002.5, "expired"),
    (b"\xff\xfe", 0.0, "bad-shape"),
    (b"[1, 2]", 0.0, "bad-shape"),
    (b'{"request_id": "x"}', 0.0, "unknown-version"),
    (json.dumps({**request_fields(), "version": 3}).encode(), 0.0, "unknown-version"),
    (json.dumps(request_fields(version=2, block_size="big")).encode(), 0.0, "bad-shape"),
    (json.dumps(request_fields(version=2, extra=1)).encode(), 0.0, "bad-shape"),
    (json.dumps(version_1_fields()).encode(), 1001.0, "ok"),
    (json.dumps(version_1_fields(block_size="big")).encode(), 0.0, "bad-shape"),
    (json.dumps(version_1_fields(extra=1)).encode(), 0.0, "bad-shape"),
])
def test_triage(payload: bytes | None, now: float, verdict: str) -> None:
    data = make_request().encode() if payload is None else payload
    result = triage(data, now)
    assert result.verdict == verdict
    assert (result.request is not None) == (verdict in ("ok", "expired"))


def test_a_job_needs_no_blocks_when_its_engine_moves_kv_itself() -> None:
    req = make_request(destination=None, handoff_subject="ns.decode.handoff.0")
    got = triage(req.encode(), now=1000.5).request
    assert got == req and got.destination is None and "nixl_agent" not in req.encode().decode()


def test_a_version_1_job_reads_as_version_2_with_its_blocks_as_the_destination() -> None:
    got = triage(json.dumps(version_1_fields(num_cached_tokens=16, block_ids=[5, 6])).encode(),
                 now=1000.5).request
    assert got is not None and got.version == 2
    assert got == make_request(num_cached_tokens=16, block_ids=[5, 6],
                               handoff_subject="ns.decode.handoff.0")
    with pytest.raises(ValidationError, match="handoff"):  # never written by version 1
        PrefillRequest.model_validate(version_1_fields(handoff={"kind": "opaque"}))


def test_no_deadline_never_expires() -> None:
    assert triage(make_request(max_wait_s=None).encode(), now=1e12).verdict == "ok"


@pytest.mark.parametrize("priority, level", [
    ("high", 0), ("default", 1), ("low", 2), (0, 0), (1, 1), (2, 2), (9, 2),
    ("unknown-class", 1),
])
def test_priority_level(priority: int | str, level: int) -> None:
    assert priority_level(priority, PrefillQueueConfig()) == level


def test_priority_level_follows_configured_classes() -> None:
    cfg = PrefillQueueConfig(priorities=("interactive", "batch"), default_priority="batch")
    assert [priority_level(p, cfg) for p in ("interactive", "batch", "x", 5)] == [0, 1, 1, 1]


JOB_PRIORITIES = {
    # case: (the job's priority, queue levels, level queued at, level the engine gets)
    "level 0": (0, ("high", "default", "low"), 0, 0),
    "level 2": (2, ("high", "default", "low"), 2, 2),
    "batch below low (level 3)": (3, ("high", "default", "low"), 2, 3),
    "a name from an earlier decode worker": ("low", ("high", "default", "low"), 2, 2),
    "an unknown name is the default class": ("batch", ("high", "default", "low"), 1, 1),
    "level 1 of a two-level queue": (1, ("interactive", "batch"), 1, 1),
}


@pytest.mark.parametrize(("priority", "levels", "queued", "engine"), JOB_PRIORITIES.values(),
                         ids=JOB_PRIORITIES.keys())
def test_the_job_round_trips_its_priority_to_the_queue_and_the_prefill_engine(
        priority: int | str, levels: tuple[str, ...], queued: int, engine: int) -> None:
    from splitserve.components.worker.prefill_loop import job_params

    req = make_request(priority=priority)
    got = triage(req.encode(), now=1000.5).request
    assert got is not None and got.priority == priority and type(got.priority) is type(priority)
    cfg = PrefillQueueConfig(priorities=levels, default_priority=levels[-2])
    assert priority_level(got.priority, cfg) == queued
    assert got.level() == engine
    assert job_params(got).priority == engine


def test_the_jobs_adapter_reaches_the_prefill_engine_and_is_written_only_when_set() -> None:
    """A job for a LoRA adapter names it, and the prefill engine computes the prompt with
    it; a job for the base model is written without the field, so a prefill worker of
    the release before (which refuses unknown fields) still reads it."""
    from splitserve.components.worker.prefill_loop import job_params

    base = make_request()
    assert "lora" not in json.loads(base.encode())
    assert job_params(triage(base.encode(), now=1000.5).request).lora is None
    adapter = make_request(lora="sql")
    got = triage(adapter.encode(), now=1000.5).request
    assert got is not None and got.lora == "sql" and job_params(got).lora == "sql"
    with pytest.raises(ValidationError, match="lora"):
        make_request(lora="")


@pytest.mark.parametrize(("min_tokens", "kept"), [(0, 0), (1, 1), (5, 1)])
def test_a_jobs_min_tokens_is_what_its_one_token_needs_and_upstream_accepts_it(
        min_tokens: int, kept: int) -> None:
    """The job's one token must not end the request early (min_tokens >= 1 keeps 1);
    more than its max_tokens of 1 is refused by vLLM's and SGLang's own validation."""
    from splitserve.components.engines.sglang.requests import sampling_params as sglang_sp
    from splitserve.components.engines.vllm.requests import sampling_params as vllm_sp
    from splitserve.components.worker.prefill_loop import job_params
    from tests.unit.engines.upstream import sglang_module

    params = job_params(make_request(min_tokens=min_tokens))
    assert params.min_tokens == kept and params.max_tokens == 1
    assert vllm_sp(params, max_tokens=1).min_tokens == kept  # vLLM validates on build
    SamplingParams = sglang_module("sglang.srt.sampling.sampling_params").SamplingParams
    real = SamplingParams(**sglang_sp(params, max_new_tokens=1))
    real.verify(vocab_size=50_000)
    assert real.min_new_tokens == kept


SHAPED = {"top_k": 5, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5,
          "repetition_penalty": 1.2, "logit_bias": [(7, -100.0), (9, 2.5)]}


def test_a_job_carries_the_requests_sampling_to_the_prefill_engine_and_upstream_accepts_it(
        ) -> None:
    """The first token is sampled as the decode side would sample it (round 2, finding
    5: top-k, min-p, penalties and bias were dropped, and engines that stream the
    prefill's token as the answer's first sampled it from another distribution)."""
    from splitserve.components.engines.sglang.requests import sampling_params as sglang_sp
    from splitserve.components.engines.vllm.requests import sampling_params as vllm_sp
    from splitserve.components.worker.prefill_loop import job_params
    from tests.unit.engines.upstream import sglang_module

    got = triage(make_request(**SHAPED, temperature=0.7).encode(), now=1000.5).request
    assert got is not None
    p = job_params(got)
    assert (p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.logit_bias) == (5, 0.05, 0.5, -0.5, 1.2,
                                                    ((7, -100.0), (9, 2.5)))
    sp = vllm_sp(p, max_tokens=1)  # vLLM validates on build
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (5, 0.05, 1.2)
    SamplingParams = sglang_module("sglang.srt.sampling.sampling_params").SamplingParams
    real = SamplingParams(**sglang_sp(p, max_new_tokens=1))
    real.verify(vocab_size=50_000)
    assert (real.top_k, real.min_p, real.repetition_penalty) == (5, 0.05, 1.2)


def test_a_plain_job_is_written_without_the_sampling_fields() -> None:
    plain = json.loads(make_request().encode())
    assert not set(SHAPED) & set(plain)  # a prefill worker of the release before reads it
    with pytest.raises(ValidationError, match="top_k"):
        make_request(top_k=-1)
