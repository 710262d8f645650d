"""An aggregated worker's request is a ``generate`` span under the frontend's, with its
first token, output tokens and outcome (tracing on); a refused one ends as an error."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.worker.agg import make_handler
from splitserve.contracts import tracing
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from tests.unit.contracts.test_tracing import exported  # noqa: F401 - the fixture
from tests.unit.worker.test_latency_metrics import REQUEST, FakeClock, PacedEngine, drain

pytestmark = pytest.mark.unit


class Context:
    """Dynamo's request context as the frontend sends it: the trace in its metadata."""

    def __init__(self, span) -> None:
        self.metadata: dict = {}
        tracing.to_dynamo(self, span)

    def is_stopped(self) -> bool:
        return False

    def is_killed(self) -> bool:
        return False


def test_an_aggregated_request_is_one_span_under_the_frontends(exported):  # noqa: F811
    handler = make_handler(PacedEngine(FakeClock()), WorkerMetrics(), worker_id=0xABC)
    stream = tracing.start("stream")
    chunks = asyncio.run(drain(handler(REQUEST, Context(stream))))
    stream.end()
    spans = {s.name: s for s in exported()}
    span = spans["generate"]
    assert span.parent.span_id == spans["stream"].context.span_id
    produced = sum(len(c.get("token_ids") or ()) for c in chunks)
    assert span.attributes["splitserve.output_tokens"] == produced > 0
    assert span.attributes["splitserve.outcome"] == chunks[-1]["finish_reason"]
    assert span.attributes["splitserve.worker_id"] == "abc"
    assert [e.name for e in span.events] == ["first_token"]


def test_a_refused_request_ends_its_span_as_an_error(exported):  # noqa: F811
    class Refusing(PacedEngine):
        def validate(self, params):
            raise ValueError("no")

    asyncio.run(drain(make_handler(Refusing(FakeClock()), WorkerMetrics())(REQUEST)))
    (span,) = exported()
    assert span.name == "generate" and span.attributes["splitserve.outcome"] == "rejected"
    assert not span.status.is_ok
