"""One mocker prefill job through the shared prefill loop, over fakes: engine, NATS
request, queue job."""

from __future__ import annotations

import nats.errors
import pytest
from prometheus_client import CollectorRegistry

from splitserve.components.worker.handoff import HandoffInbox, PrefillHandoff
from splitserve.components.engines.mocker.adapter import MockerEngine
from splitserve.components.worker.disagg_metrics import PrefillMetrics
from splitserve.components.worker.prefill_loop import PrefillLoopSettings, prefill_one
from tests.unit.prefill_queue.factories import make_request

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


class PrefillEngine:
    """A prefill-mode mocker: one token with `disaggregated_params`, then the end."""

    role = "prefill"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.requests: list[dict] = []

    async def stream(self, request: dict, idle_timeout_s: float):
        self.requests.append(request)
        if self.fail:
            raise RuntimeError("engine went away")
        yield {"token_ids": [9], "disaggregated_params": "dummy", "finish_reason": None}
        yield {"token_ids": [], "finish_reason": "length"}


class Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class FakeNats:
    """``request`` answers through a real HandoffInbox, or raises as told."""

    def __init__(self, inbox: HandoffInbox | None, error: Exception | None = None) -> None:
        self.inbox = inbox
        self.error = error
        self.sent: list[tuple[str, PrefillHandoff]] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> Reply:  # noqa: ASYNC109 - nats-py's
        self.sent.append((subject, PrefillHandoff.model_validate_json(data)))
        if self.error is not None:
            raise self.error
        return Reply(self.inbox.take(data).model_dump_json().encode())


class FakeJob:
    def __init__(self, **request_fields) -> None:
        self.request = make_request(**request_fields)
        self.delivery_count = 1
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay_s: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self, reason: str = "terminated") -> None:
        self.settled.append(f"term:{reason}")

    async def in_progress(self) -> None:
        pass


def outcome(metrics: PrefillMetrics) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in metrics.jobs.collect()
            for s in m.samples if s.name.endswith("_total")}


async def run_one(job: FakeJob, nc: FakeNats, engine: PrefillEngine | None = None):
    metrics = PrefillMetrics(CollectorRegistry())
    mocker = MockerEngine({"prefill": engine or PrefillEngine()}, "m", 16, 1024, 5.0)
    await prefill_one(mocker, nc, job, PrefillLoopSettings(), 0xBEEF, metrics)
    return outcome(metrics)


async def test_result_reaches_the_waiting_decode_worker_before_the_ack():
    inbox = HandoffInbox()
    waiting = inbox.expect("r1")
    nc = FakeNats(inbox)
    job = FakeJob(handoff_subject="subj.d1")
    assert await run_one(job, nc) == {"done": 1.0}
    assert job.settled == ["ack"]
    handoff = waiting.result()
    assert handoff.first_token == 9
    assert handoff.disaggregated_params == {"version": 1, "kind": "opaque",
                                            "disaggregated_params": "dummy"}
    assert handoff.prefill_worker_id == "beef" and nc.sent[0][0] == "subj.d1"


@pytest.mark.parametrize(("error", "fields", "engine_fails", "expected", "settled"), [
    (None, {}, False, "orphaned", ["ack"]),  # the decode worker already went local
    (nats.errors.NoRespondersError(), {}, False, "decode-gone", ["term:decode-gone"]),
    (nats.errors.TimeoutError(), {}, False, "failed", ["nak"]),
    (None, {}, True, "failed", ["nak"]),
    (None, {"handoff_subject": None}, False, "unservable", ["term:no-handoff-subject"]),
])
async def test_every_job_is_settled_exactly_once(error, fields, engine_fails, expected,
                                                 settled):
    job = FakeJob(**{"handoff_subject": "subj.d1", **fields})
    result = await run_one(job, FakeNats(HandoffInbox(), error),
                           PrefillEngine(fail=engine_fails))
    assert result == {expected: 1.0}
    assert job.settled == settled
