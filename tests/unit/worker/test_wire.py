"""The one wire <-> engine mapping: priorities, finish reasons, chunks."""

from __future__ import annotations

import pytest

from splitserve.contracts.engine import TokenDelta
from splitserve.contracts.wire import WorkerRequest, worker_request
from splitserve.components.worker.wire import delta_chunk, params_from_wire, wire_finish

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("priority", "rank"), [("high", 2), ("normal", 1), ("default", 1),
                                                ("low", 0), ("unheard-of", 1)])
def test_priority_names_rank_with_unknown_as_normal(priority, rank):
    req = worker_request(model="m", token_ids=[1, 2], max_tokens=3, temperature=0.0,
                         top_p=None, seed=None, eos_token_ids=[2], request_id="r",
                         priority=priority)
    assert params_from_wire(WorkerRequest.model_validate(req)).priority == rank


@pytest.mark.parametrize(("engine", "wire"), [("stop", "eos"), ("length", "length"),
                                              ("abort", "cancelled"), ("error", "error"),
                                              (None, "eos")])
def test_one_finish_vocabulary_for_every_path(engine, wire):
    assert wire_finish(engine) == wire


def test_only_the_last_chunk_carries_the_finish_reason_and_usage():
    first = delta_chunk(TokenDelta(token_ids=(5,)), produced=1)
    assert first == {"token_ids": [5]}
    last = delta_chunk(TokenDelta(token_ids=(6,), finished=True, finish_reason="length",
                                  prompt_tokens=4, cached_tokens=2), produced=2)
    assert last["finish_reason"] == "length"
    assert last["completion_usage"]["completion_tokens"] == 2
    assert last["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
