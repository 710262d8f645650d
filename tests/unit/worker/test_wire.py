"""The one wire <-> engine mapping: priority levels, finish reasons, chunks."""

from __future__ import annotations

import pytest

from splitserve.contracts.engine import TokenDelta
from splitserve.contracts.wire import FinishReason, WorkerRequest, worker_request
from splitserve.components.worker.wire import delta_chunk, params_from_wire

pytestmark = pytest.mark.unit


def wire(priority: str, level: int | None = None) -> WorkerRequest:
    req = worker_request(model="m", token_ids=[1, 2], max_tokens=3, temperature=0.0,
                         top_p=None, seed=None, eos_token_ids=[2], request_id="r",
                         priority=priority)
    if level is not None:
        req["extra_args"]["splitserve"]["priority_level"] = level
    return WorkerRequest.model_validate(req)


LEVELS = {
    # case: (wire priority name, level the router put on it, level the engine gets)
    "router's level for batch": ("batch", 3, 3),
    "router's level wins over the name": ("high", 2, 2),
    "router's level 0": ("interactive", 0, 0),
    "no router: high": ("high", None, 0),
    "no router: default": ("default", None, 1),
    "no router: low": ("low", None, 2),
    "no router: case and space": (" LOW", None, 2),
    "no router: batch is not a built-in class": ("batch", None, 1),
    "no router: unknown is the default class": ("unheard-of", None, 1),
}


@pytest.mark.parametrize(("name", "level", "expected"), LEVELS.values(), ids=LEVELS.keys())
def test_the_engine_gets_the_routers_level_or_the_built_in_tables(name, level, expected):
    assert params_from_wire(wire(name, level)).priority == expected


def test_a_negative_level_is_refused_on_the_wire():
    with pytest.raises(ValueError, match="priority_level"):
        wire("high", -1).meta()


@pytest.mark.parametrize("reason", list(FinishReason))
def test_engines_and_the_wire_share_one_finish_vocabulary(reason):
    chunk = delta_chunk(TokenDelta(token_ids=(), finished=True, finish_reason=reason),
                        produced=0)
    assert chunk["finish_reason"] == reason.value
    assert type(chunk["finish_reason"]) is str  # a plain string on the wire


def test_a_finished_delta_without_a_reason_is_eos():
    chunk = delta_chunk(TokenDelta(token_ids=(4,), finished=True), produced=1)
    assert chunk["finish_reason"] == "eos"


@pytest.mark.parametrize(("raw", "reason"), [
    ("eos", FinishReason.EOS), ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
    ("cancelled", FinishReason.CANCELLED), ("error", FinishReason.ERROR),
    ("content_filter", FinishReason.EOS)])
def test_wire_reasons_read_back_and_foreign_ones_are_a_normal_end(raw, reason):
    assert FinishReason.from_wire(raw) is reason


def test_only_the_last_chunk_carries_the_finish_reason_and_usage():
    first = delta_chunk(TokenDelta(token_ids=(5,)), produced=1)
    assert first == {"token_ids": [5]}
    last = delta_chunk(TokenDelta(token_ids=(6,), finished=True,
                                  finish_reason=FinishReason.LENGTH, prompt_tokens=4,
                                  cached_tokens=2), produced=2)
    assert last["finish_reason"] == "length"
    assert last["completion_usage"]["completion_tokens"] == 2
    assert last["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.parametrize("stop", [{}, {"max_tokens": None}, {"max_tokens": 0}])
def test_every_shell_refuses_a_request_without_max_tokens(stop):
    # The aggregated and decode shells read requests through this one function: neither
    # makes up a length for a caller that gave none.
    raw = {"token_ids": [1, 2], "stop_conditions": stop}
    with pytest.raises(ValueError, match="max_tokens"):
        params_from_wire(WorkerRequest.model_validate(raw))
    assert params_from_wire(WorkerRequest.model_validate(
        {**raw, "stop_conditions": {"max_tokens": 1}})).max_tokens == 1


def test_every_shell_refuses_a_request_without_a_prompt():
    with pytest.raises(ValueError, match="token_ids"):
        params_from_wire(WorkerRequest.model_validate(
            {"token_ids": [], "stop_conditions": {"max_tokens": 4}}))
