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
from tests.unit.prefill_queue.factories import FakeJob

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


class RefusingEngine:
    """An engine that refuses every job as vLLM refuses invalid sampling parameters."""

    def __init__(self) -> None:
        mocker = MockerEngine({"prefill": PrefillEngine()}, "m", 16, 1024, 5.0)
        self.info = mocker.info
        self.calls = 0

    async def prefill(self, request_id, params, **kwargs):
        self.calls += 1
        raise ValueError("min_tokens must be less than or equal to max_tokens=1, got 5")


async def test_a_job_its_engine_refuses_ends_at_once_and_its_decode_worker_is_told():
    """A refusal fails on every delivery alike: no redelivery, and the decode worker
    hears it now instead of waiting out its timeout (it then prefills locally)."""
    inbox = HandoffInbox()
    waiting = inbox.expect("r1")
    job = FakeJob(handoff_subject="subj.d1")
    engine = RefusingEngine()
    metrics = PrefillMetrics(CollectorRegistry())
    await prefill_one(engine, FakeNats(inbox), job, PrefillLoopSettings(), 0xBEEF, metrics)
    assert outcome(metrics) == {"refused": 1.0} and engine.calls == 1
    assert job.settled == ["term:refused"]
    told = waiting.result()
    assert told.refused is not None and "min_tokens" in told.refused
    assert told.refused.startswith(f"{engine.info.name}: ")


async def test_a_result_is_written_without_the_refusal_field():
    """A decode worker of the release before refuses unknown fields: results stay
    readable to it."""
    import json

    ok = PrefillHandoff(request_id="r", first_token=3, prefill_worker_id="p",
                        compute_s=0.1, transfer_s=0.0)
    assert "refused" not in json.loads(ok.encode())


async def test_a_prefill_that_ended_the_request_hands_over_its_token_and_reason():
    from splitserve.contracts.engine import PrefillResult
    from splitserve.contracts.wire import FinishReason

    class EndsAtOnce(RefusingEngine):
        async def prefill(self, request_id, params, **kwargs):
            return PrefillResult(first_token=2, handoff=None, finished=FinishReason.EOS)

    inbox = HandoffInbox()
    waiting = inbox.expect("r1")
    job = FakeJob(handoff_subject="subj.d1")
    metrics = PrefillMetrics(CollectorRegistry())
    await prefill_one(EndsAtOnce(), FakeNats(inbox), job, PrefillLoopSettings(), 0xBEEF,
                      metrics)
    assert outcome(metrics) == {"done": 1.0} and job.settled == ["ack"]
    told = waiting.result()
    assert (told.first_token, told.finish_reason, told.disaggregated_params) == (2, "eos", None)


async def test_each_enqueue_and_delivery_of_a_request_has_its_own_engine_id():
    """A request prefilled again (resumed on, or resent to, another decode worker) while
    a prefill engine still holds its earlier job must not reuse that job's engine id:
    every engine refuses an id already running, and the prefill loop takes a refusal as
    final."""
    from splitserve.components.worker.prefill_loop import engine_request_id
    from tests.unit.prefill_queue.factories import make_request

    first = make_request(request_id="r", enqueued_at=100.0)
    resumed = make_request(request_id="r", enqueued_at=101.5,
                           token_ids=[*first.token_ids, 7, 8])
    resent = make_request(request_id="r", enqueued_at=100.0, decode_worker_id="decode-9")
    ids = [engine_request_id(first, 1), engine_request_id(first, 2),
           engine_request_id(resumed, 1), engine_request_id(resent, 1)]
    assert len(set(ids)) == 4
    assert engine_request_id(first, 1) == engine_request_id(first, 1)  # stable
    # the request id is everything before the last "@" (what the torch engine notifies)
    assert {i.rsplit("@", 1)[0] for i in ids} == {"r"}
    assert engine_request_id(make_request(request_id="a@b", enqueued_at=1.0), 3) \
        .rsplit("@", 1)[0] == "a@b"
