"""Latency by pool on the workers' /metrics: the decode and aggregated shells time TTFT
and ITL per request, the prefill loop times each job's queue wait, compute and KV
transfer, all labelled by the pool as `dynamo status` names it and the served model,
with the labelled children bound once (no label lookup while a request streams)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from splitserve.components.worker.agg import make_handler
from splitserve.components.worker.coordinator import (
    CoordinatorSettings,
    EngineDecodeCoordinator,
)
from splitserve.components.worker.disagg_metrics import DisaggMetrics, PrefillMetrics
from splitserve.components.worker.handoff import HandoffInbox, PrefillHandoff
from splitserve.components.worker.latency_metrics import (
    COMPUTE,
    ITL,
    QUEUE_WAIT,
    TRANSFER,
    TTFT,
    TokenLatency,
    worker_labels,
)
from splitserve.components.worker.prefill_loop import PrefillLoopSettings, prefill_one
from splitserve.contracts.engine import (
    EngineCapabilities,
    EngineInfo,
    GenerateParams,
    LoadSample,
    PrefillResult,
    TokenDelta,
)
from splitserve.contracts.kit.worker_metrics import WorkerMetrics
from splitserve.contracts.wire import FinishReason
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import build_plan
from tests.unit.prefill_queue.factories import FakeJob

pytestmark = pytest.mark.unit

POOL, MODEL = "Worker@qwen", "my-qwen"
LABELS = {"pool": POOL, "model": MODEL}
REQUEST = {"token_ids": [3, 4, 5], "stop_conditions": {"max_tokens": 4}}


class FakeClock:
    """A monotonic clock the engine below moves forward."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class PacedEngine:
    """Answers after ``first_s`` with one token, then a delta every ``gap_s`` (the
    second one with two tokens), on a fake clock; prefills locally."""

    def __init__(self, clock: FakeClock, first_s: float = 0.3, gap_s: float = 0.04) -> None:
        caps = EngineCapabilities(local_prefill=True, pushes_kv=False,
                                  handoff_before_prefill=False, prefix_lookup=False,
                                  moves_kv=False, reports_failure=False, serves_lora=False)
        self.info = EngineInfo("paced", 16, caps)
        self.clock, self.first_s, self.gap_s = clock, first_s, gap_s

    def validate(self, params: GenerateParams) -> None:
        pass

    async def generate(self, request_id: str, params: GenerateParams):
        self.clock.t += self.first_s
        yield TokenDelta((7,))
        self.clock.t += self.gap_s
        yield TokenDelta((8, 9))
        self.clock.t += self.gap_s
        yield TokenDelta((10,), True, FinishReason.LENGTH, len(params.token_ids), 0)

    def load(self) -> LoadSample:
        return LoadSample(0, 0, 0, 100)

    def inflight(self) -> int:
        return 0


class LocalAlways:
    def decide(self, request, snapshot):
        from splitserve.components.disagg import OffloadDecision

        return OffloadDecision(remote=False, reason="forced")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels or LABELS) or 0.0


def no_label_lookups(monkeypatch) -> None:
    """From now on, a label lookup on any histogram fails the test."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("a label lookup while serving")

    monkeypatch.setattr(Histogram, "labels", refuse)


async def drain(stream) -> list[dict]:
    return [chunk async for chunk in stream]


def test_the_pool_label_is_the_name_the_status_table_shows(smollm2_dir, tmp_path):
    g = load_graph("splitserve.graphs.disagg:Frontend")
    raw = {"DecodeWorker": {"engine": "torch"}, "PrefillWorker": {"engine": "torch"},
           "Models": {"qwen": {"model": str(smollm2_dir),
                               "served_model_name": MODEL}}}
    plan = build_plan(g, "splitserve.graphs.disagg:Frontend", raw, "cfg.yaml",
                      known_sections=g.defined)
    got = {c.name: worker_labels(plan.run_config(c, 0, tmp_path / f"{c.name}.json"))
           for c in plan.components if c.name.split("@")[0].endswith("Worker")}
    first = plan.common.served_model_name
    assert got == {"DecodeWorker": ("DecodeWorker", first),
                   "PrefillWorker": ("PrefillWorker", first),
                   "DecodeWorker@qwen": ("DecodeWorker@qwen", MODEL),
                   "PrefillWorker@qwen": ("PrefillWorker@qwen", MODEL)}


def test_a_decode_worker_times_ttft_from_arrival_and_itl_per_token(monkeypatch):
    clock = FakeClock()
    metrics = WorkerMetrics()
    coord = EngineDecodeCoordinator(
        PacedEngine(clock), LocalAlways(), None, HandoffInbox(), "subject", 0xABC,
        live_prefill_workers=lambda: 0, queue_depth=lambda: 0,
        metrics=DisaggMetrics(metrics.registry), settings=CoordinatorSettings(),
        requests=metrics.requests)
    coord.latency = TokenLatency(metrics.registry, POOL, MODEL, now=clock)
    no_label_lookups(monkeypatch)
    chunks = asyncio.run(drain(coord.generate(REQUEST)))
    assert chunks[-1]["finish_reason"] == "length"
    r = metrics.registry
    assert value(r, f"{TTFT}_count") == 1
    assert value(r, f"{TTFT}_sum") == pytest.approx(0.3)
    # two gaps of 40 ms: one delta of 2 tokens (20 ms each), one of 1 token
    assert value(r, f"{ITL}_count") == 2
    assert value(r, f"{ITL}_sum") == pytest.approx(0.02 + 0.04)
    assert value(r, f"{TTFT}_bucket", le="0.5", **LABELS) == 1
    assert value(r, f"{TTFT}_bucket", le="0.2", **LABELS) == 0


def test_a_refused_request_is_not_timed():
    clock = FakeClock()
    metrics = WorkerMetrics()

    class Refusing(PacedEngine):
        def validate(self, params):
            raise ValueError("no")

    latency = TokenLatency(metrics.registry, POOL, MODEL, now=clock)
    handler = make_handler(Refusing(clock), metrics, latency=latency)
    chunks = asyncio.run(drain(handler(REQUEST)))
    assert "request refused" in chunks[0]["error"]
    assert value(metrics.registry, f"{TTFT}_count") == 0


def test_an_aggregated_worker_times_its_requests(monkeypatch):
    clock = FakeClock()
    metrics = WorkerMetrics()
    latency = TokenLatency(metrics.registry, POOL, MODEL, now=clock)
    handler = make_handler(PacedEngine(clock, first_s=1.5, gap_s=0.01), metrics,
                           latency=latency)
    no_label_lookups(monkeypatch)
    for _ in range(2):
        asyncio.run(drain(handler(REQUEST)))
    r = metrics.registry
    assert (value(r, f"{TTFT}_count"), value(r, f"{TTFT}_sum")) == (2, pytest.approx(3.0))
    assert (value(r, f"{ITL}_count"), value(r, f"{ITL}_sum")) == (4, pytest.approx(0.03))


def test_output_continued_from_another_worker_counts_no_ttft():
    clock = FakeClock()
    registry = CollectorRegistry()
    c = TokenLatency(registry, POOL, MODEL, now=clock).clock(first_token=False)
    clock.t += 2.0
    c.tokens(1)  # the first token here is not the request's first
    clock.t += 0.1
    c.tokens(0)  # a delta without tokens moves nothing
    c.tokens(1)
    assert value(registry, f"{TTFT}_count") == 0
    assert (value(registry, f"{ITL}_count"), value(registry, f"{ITL}_sum")) == (
        1, pytest.approx(0.1))


# ---- the prefill loop ------------------------------------------------------------------

class EndsAtOnce:
    """A prefill engine whose one job took 250 ms to compute and 50 ms to write."""

    def __init__(self) -> None:
        caps = EngineCapabilities(local_prefill=True, pushes_kv=False,
                                  handoff_before_prefill=False, prefix_lookup=False,
                                  moves_kv=False, reports_failure=False, serves_lora=False)
        self.info = EngineInfo("paced", 16, caps)

    async def prefill(self, request_id, params, **kwargs):
        return PrefillResult(first_token=2, handoff=None, finished=FinishReason.EOS,
                             compute_s=0.25, transfer_s=0.05, transfer_bytes=4096)


class Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class Nats:
    def __init__(self, inbox: HandoffInbox) -> None:
        self.inbox = inbox

    async def request(self, subject: str, data: bytes, timeout: float) -> Reply:  # noqa: ASYNC109 - nats-py's
        PrefillHandoff.model_validate_json(data)
        return Reply(self.inbox.take(data).model_dump_json().encode())


def test_a_prefill_job_times_its_queue_wait_compute_and_transfer(monkeypatch):
    metrics = PrefillMetrics(CollectorRegistry(), "PrefillWorker@qwen", MODEL)
    labels = {"pool": "PrefillWorker@qwen", "model": MODEL}
    job = FakeJob(handoff_subject="subj.d1", enqueued_at=time.time() - 2.0)
    no_label_lookups(monkeypatch)

    async def one() -> str:
        inbox = HandoffInbox()
        inbox.expect("r1")  # the decode worker waits for it
        return await prefill_one(EndsAtOnce(), Nats(inbox), job, PrefillLoopSettings(),
                                 0xBEEF, metrics)

    outcome = asyncio.run(one())
    assert (outcome, job.settled) == ("done", ["ack"])
    r = metrics.registry
    wait = value(r, f"{QUEUE_WAIT}_sum", **labels)
    assert value(r, f"{QUEUE_WAIT}_count", **labels) == 1 and 2.0 <= wait < 10.0
    assert value(r, f"{COMPUTE}_sum", **labels) == pytest.approx(0.25)
    assert value(r, f"{TRANSFER}_sum", **labels) == pytest.approx(0.05)
    # the unlabelled series keep counting as before
    assert r.get_sample_value("splitserve_prefill_compute_seconds_sum") == pytest.approx(0.25)
    assert r.get_sample_value("splitserve_prefill_transfer_seconds_sum") == pytest.approx(0.05)
    assert r.get_sample_value("splitserve_prefill_transfer_bytes_total") == 4096


def test_a_job_enqueued_by_a_clock_ahead_waited_zero():
    metrics = PrefillMetrics(CollectorRegistry(), POOL, MODEL)
    metrics.latency.picked_up(enqueued_at=1000.5, now=1000.0)
    assert value(metrics.registry, f"{QUEUE_WAIT}_count") == 1
    assert value(metrics.registry, f"{QUEUE_WAIT}_sum") == 0.0
