"""The decode coordinator and prefill loop for SGLang and TensorRT-LLM, driven in process
with the engine doubles (which enforce each engine's disaggregation rules) over a real
NATS JetStream prefill queue and the real NATS handoff request/reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Self

import nats
import pytest
from prometheus_client import CollectorRegistry

from splitserve.components.engines.sglang.requests import sglang_rid
from splitserve.contracts.metrics import PREFIX
from splitserve.components.disagg.forced import ForcedDecider, Params
from splitserve.contracts.engine import GenerateParams
from splitserve.components.engines.sglang.config import SglangEngineArgs
from splitserve.components.engines.sglang.engine import SglangEngine
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from splitserve.components.worker.handoff import HandoffInbox, handoff_subject
from splitserve.components.prefill_queue import PrefillQueue, PrefillQueueConfig
from splitserve.contracts.wire import chunk_data, worker_request
from splitserve.components.worker.coordinator import (
    CoordinatorSettings,
    EngineDecodeCoordinator,
    Rejected,
)
from splitserve.components.worker.disagg_metrics import DisaggMetrics, PrefillMetrics
from splitserve.components.worker.prefill_loop import PrefillLoopSettings, pull_loop
from splitserve.infra.embedded import EmbeddedInfra
from tests.fixtures.engine_doubles import (
    BootstrapRooms,
    LlmApiDouble,
    SglangEngineDouble,
    tokens_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(30),
              pytest.mark.quiet]

MODEL = "org/model"
PROMPT = (5, 6, 7, 8, 9)
P = GenerateParams(token_ids=PROMPT, max_tokens=6, temperature=0.0)
EXPECTED = tokens_for(list(PROMPT), 6)
ARGS = SglangEngineArgs.model_construct(**{
    k: f.default for k, f in SglangEngineArgs.model_fields.items() if k != "extra_server_args"},
    extra_server_args={})


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with EmbeddedInfra(tmp_path_factory.mktemp("infra")) as ep:
        yield ep


@pytest.fixture(scope="module")
def nats_url(infra) -> str:
    return infra.nats


def qconfig() -> PrefillQueueConfig:
    return PrefillQueueConfig.model_validate({
        "ack_wait_s": 1.0, "max_deliver": 5, "idle_recheck_s": 0.1, "depth_refresh_s": 0.1,
        "request_timeout_s": 1.0, "max_age_s": 30.0, "duplicate_window_s": 5.0,
        "storage": "memory"})


DOUBLES: dict[SglangEngine, SglangEngineDouble] = {}


def double_of(engine: SglangEngine) -> SglangEngineDouble:
    """The SGLang double an adapter was built with (recorded by its factory)."""
    return DOUBLES[engine]


async def sglang(role: str, rooms: BootstrapRooms) -> SglangEngine:
    built: list[SglangEngineDouble] = []

    def factory(**a):
        built.append(SglangEngineDouble(rooms, **a))
        return built[-1]

    e = SglangEngine(ARGS, "m", role, factory=factory)
    await e.start()
    DOUBLES[e] = built[0]
    return e


async def trtllm(role: str, states: dict) -> TrtllmEngine:
    e = TrtllmEngine(TrtllmEngineArgs(), "m", role,
                     api_factory=lambda: LlmApiDouble(role, states))
    await e.start()
    return e


class Rig:
    """One decode coordinator and any number of prefill loops on one namespace."""

    def __init__(self, url: str, decode_engine, *, remote: bool, live: int = 1,
                 **settings: float) -> None:
        self.url, self.engine, self.remote, self.live = url, decode_engine, remote, live
        self.settings = CoordinatorSettings(**{"remote_prefill_timeout_s": 10.0,
                                               "no_prefill_worker_wait_s": 0.5,
                                               "poll_s": 0.05, **settings})
        self.ns = f"t{uuid.uuid4().hex[:8]}"
        self.registry = CollectorRegistry()
        self.prefill_metrics = PrefillMetrics(CollectorRegistry())
        self.stopping = asyncio.Event()
        self.loops: list[asyncio.Task] = []
        self.closers: list = []

    async def __aenter__(self) -> Self:
        self.queue = await PrefillQueue.connect(self.url, self.ns, MODEL, qconfig())
        self.closers.append(self.queue.close)
        self.nc = await nats.connect(self.url)
        self.closers.append(self.nc.close)
        inbox = HandoffInbox()
        subject = handoff_subject(self.ns, "DecodeWorker", 0xD1)
        await self.nc.subscribe(subject, cb=inbox.on_message)
        self.coord = EngineDecodeCoordinator(
            self.engine, ForcedDecider(Params(remote=self.remote)), self.queue, inbox,
            subject, 0xD1, live_prefill_workers=lambda: self.live, queue_depth=lambda: 0,
            metrics=DisaggMetrics(self.registry), settings=self.settings)
        return self

    async def start_prefill(self, engine, worker_id: int = 0xA1) -> None:
        q = await PrefillQueue.connect(self.url, self.ns, MODEL, qconfig())
        self.closers.append(q.close)
        self.loops.append(asyncio.create_task(pull_loop(
            engine, self.nc, q, PrefillLoopSettings(heartbeat_s=0.3, handoff_timeout_s=2.0),
            worker_id, self.prefill_metrics, self.stopping)))

    def decisions(self, where: str, reason: str) -> float:
        return self.registry.get_sample_value(f"{PREFIX}_disagg_decisions_total",
                                              {"where": where, "reason": reason}) or 0.0

    def jobs(self, outcome: str) -> float:
        return self.prefill_metrics.registry.get_sample_value(
            f"{PREFIX}_prefill_jobs_total", {"outcome": outcome}) or 0.0

    async def __aexit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.loops:
            t.cancel()
        await asyncio.gather(*self.loops, return_exceptions=True)
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(close(), 5)


async def tokens(coord: EngineDecodeCoordinator, rid: str) -> list[int]:
    out: list[int] = []
    async for d in coord.serve(rid, P):
        out += d.token_ids
    return out


async def test_sglang_remote_end_to_end(nats_url: str) -> None:
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    async with Rig(nats_url, dec, remote=True) as rig:
        await rig.start_prefill(pre)
        assert await tokens(rig.coord, "r1") == EXPECTED
        assert rig.decisions("remote", "forced-remote") == 1
        for _ in range(50):  # the prefill side acks after its result
            if rig.jobs("done"):
                break
            await asyncio.sleep(0.05)
        assert rig.jobs("done") == 1
        # one room, created by the prefill side and joined by the decode engine
        [room] = rooms.used
        assert double_of(dec).calls[0]["bootstrap_room"] == room


async def test_a_request_resumed_on_the_same_decode_worker_is_prefilled_again(
        nats_url: str) -> None:
    """A request moved here mid-answer keeps its id and comes with a longer prompt (its
    prompt plus the tokens streamed): its second remote prefill is a job of its own, not
    a duplicate the queue drops while the decode worker waits out its timeout."""
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    async with Rig(nats_url, dec, remote=True) as rig:
        await rig.start_prefill(pre)
        assert await tokens(rig.coord, "moved") == EXPECTED
        resumed = GenerateParams(token_ids=PROMPT + tuple(EXPECTED[:2]), max_tokens=4,
                                 temperature=0.0)
        t0 = time.monotonic()
        out = [t async for d in rig.coord.serve("moved", resumed) for t in d.token_ids]
        assert out == tokens_for(list(resumed.token_ids), 4)
        assert time.monotonic() - t0 < 5.0  # its timeout is 10 s
        assert rig.registry.get_sample_value(
            f"{PREFIX}_disagg_fallbacks_total", {"reason": "timeout"}) is None
        for _ in range(50):  # the prefill side acks after its result
            if rig.jobs("done") == 2:
                break
            await asyncio.sleep(0.05)
        assert rig.jobs("done") == 2


async def test_sglang_local_verdict_served_remotely_and_counted(nats_url: str) -> None:
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    assert not dec.info.capabilities.local_prefill
    async with Rig(nats_url, dec, remote=False) as rig:
        await rig.start_prefill(pre)
        assert await tokens(rig.coord, "r2") == EXPECTED
        assert rig.decisions("remote", "engine-no-local-prefill") == 1
        assert rig.decisions("local", "forced-local") == 0


async def test_no_prefill_worker_bounded_wait_then_503(nats_url: str) -> None:
    rooms = BootstrapRooms()
    dec = await sglang("decode", rooms)
    async with Rig(nats_url, dec, remote=True, live=0, retry_after_s=3.0) as rig:
        t0 = time.monotonic()
        with pytest.raises(Rejected) as err:
            await tokens(rig.coord, "r3")
        waited = time.monotonic() - t0
        assert 0.45 <= waited < 3.0
        assert err.value.retry_after_s == 3.0 and err.value.reason == "no-prefill-worker"
        assert rig.decisions("rejected", "no-prefill-worker") == 1
        req = worker_request(model=MODEL, token_ids=list(PROMPT), max_tokens=4,
                             temperature=0.0, top_p=None, seed=None, eos_token_ids=[],
                             request_id="r3b", priority="default")
        chunks = [c async for c in rig.coord.generate(req)]
        assert chunks[-1]["finish_reason"] == "error" and chunks[-1]["retry_after_s"] == 3.0
        assert dec.inflight() == 0 and rig.coord.inflight == 0


async def test_trtllm_remote_uses_opaque_state_once(nats_url: str) -> None:
    states: dict = {}
    dec, pre = await trtllm("decode", states), await trtllm("prefill", states)
    async with Rig(nats_url, dec, remote=True) as rig:
        await rig.start_prefill(pre)
        assert await tokens(rig.coord, "r4") == EXPECTED
        assert states == {}  # the context state was created and consumed once
        kinds = [c["disaggregated_params"].request_type for c in dec.api.llm.calls]
        assert kinds == ["generation_only"]
        assert [c["disaggregated_params"].request_type for c in pre.api.llm.calls] == \
            ["context_only"]


async def test_trtllm_local_is_context_and_generation(nats_url: str) -> None:
    dec = await trtllm("decode", {})
    async with Rig(nats_url, dec, remote=False, live=0) as rig:
        assert await tokens(rig.coord, "r5") == EXPECTED
        assert [c["disaggregated_params"].request_type for c in dec.api.llm.calls] == \
            ["context_and_generation"]
        assert rig.decisions("local", "forced-local") == 1


async def test_cancellation_mid_stream_aborts_in_engine(nats_url: str) -> None:
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    async with Rig(nats_url, dec, remote=True) as rig:
        await rig.start_prefill(pre)
        stream = rig.coord.serve("r6", GenerateParams(token_ids=PROMPT, max_tokens=50))
        got = [await anext(stream), await anext(stream)]
        assert len(got) == 2
        await stream.aclose()  # the client went away
        assert sglang_rid("r6") in double_of(dec).aborted
        assert dec.inflight() == 0 and rig.coord.inflight == 0


async def test_prefill_worker_dies_mid_job_then_redelivered(nats_url: str) -> None:
    states: dict = {}
    dec, pre = await trtllm("decode", states), await trtllm("prefill", states)
    async with Rig(nats_url, dec, remote=True) as rig:
        dead = await PrefillQueue.connect(nats_url, rig.ns, MODEL, qconfig())
        rig.closers.append(dead.close)
        serving = asyncio.create_task(tokens(rig.coord, "r7"))
        taken = []
        for _ in range(40):  # a worker pulls the job and dies without settling it
            taken = await dead.pull(wait_s=0.2)
            if taken:
                break
        assert taken and taken[0].request.request_id == "r7"
        await rig.start_prefill(pre)  # a live worker gets it after ack_wait (1 s)
        assert await asyncio.wait_for(serving, 15) == EXPECTED
        assert states == {}


async def test_remote_timeout_falls_back_per_engine(nats_url: str) -> None:
    # no prefill loop consumes the job: TRT-LLM prefills locally, SGLang answers 503
    dec = await trtllm("decode", {})
    async with Rig(nats_url, dec, remote=True, remote_prefill_timeout_s=0.3) as rig:
        assert await tokens(rig.coord, "r8") == EXPECTED
        assert rig.registry.get_sample_value(f"{PREFIX}_disagg_fallbacks_total",
                                             {"reason": "timeout"}) == 1
    sdec = await sglang("decode", BootstrapRooms())
    async with Rig(nats_url, sdec, remote=True, remote_prefill_timeout_s=0.3) as rig:
        with pytest.raises(Rejected):
            await tokens(rig.coord, "r9")


async def test_jobs_are_engine_neutral_and_old_jobs_still_parse() -> None:
    from splitserve.components.prefill_queue import PrefillRequest, triage
    from splitserve.contracts.engine import TorchBlocksHandoff

    old = {"version": 1, "request_id": "o", "token_ids": [1, 2], "decode_worker_id": "d",
           "nixl_agent": "a", "block_ids": [0], "block_size": 16, "enqueued_at": time.time(),
           "handoff_subject": "ns.d.handoff"}
    got = triage(json.dumps(old).encode(), time.time())
    assert got.verdict == "ok" and got.request.version == 2
    assert got.request.destination == TorchBlocksHandoff(nixl_agent="a", block_ids=[0],
                                                         block_size=16)
    neutral = PrefillRequest(request_id="n", token_ids=[1, 2], decode_worker_id="d",
                             enqueued_at=time.time(), handoff_subject="ns.d.handoff")
    got = triage(neutral.encode(), time.time())
    assert got.verdict == "ok" and got.request.destination is None
    bad = triage(json.dumps({**old, "handoff": {"kind": "nope"}}).encode(), time.time())
    assert bad.verdict == "bad-shape"


async def test_generate_endpoint_streams_chunks_and_explain_shows_the_plan(
        nats_url: str) -> None:
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    async with Rig(nats_url, dec, remote=False) as rig:
        await rig.start_prefill(pre)
        req = worker_request(model=MODEL, token_ids=list(PROMPT), max_tokens=6,
                             temperature=0.0, top_p=None, seed=None, eos_token_ids=[],
                             request_id="g1", priority="default")
        chunks = [c async for c in rig.coord.generate(req)]
        assert [t for c in chunks for t in c["token_ids"]] == EXPECTED
        assert chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["completion_usage"]["completion_tokens"] == 6
        [answer] = [a async for a in rig.coord.explain({"token_ids": list(PROMPT)})]
        assert answer["decision"]["remote"] is False
        assert answer["plan"] == {"action": "remote", "reason": "engine-no-local-prefill"}


async def test_worker_processes_serve_through_dynamo(infra, monkeypatch, tmp_path) -> None:
    """The DecodeWorker and PrefillWorker mains, in process on a real Dynamo runtime
    (etcd discovery, TCP request plane), with TensorRT-LLM doubles as their engines."""
    from splitserve.components.engines.trtllm import engine as trtllm_engine
    from splitserve.components.worker import decode_main, prefill_main
    from splitserve.contracts.kit.component import ComponentContext, make_runtime
    from splitserve.contracts.config import CommonConfig
    from splitserve.contracts.config import ComponentRunConfig

    monkeypatch.setenv("ETCD_ENDPOINTS", infra.etcd)
    monkeypatch.setenv("NATS_SERVER", infra.nats)
    states: dict = {}
    engines = {"decode": TrtllmEngine(TrtllmEngineArgs(), "m", "decode",
                                      api_factory=lambda: LlmApiDouble("decode", states)),
               "prefill": TrtllmEngine(TrtllmEngineArgs(), "m", "prefill",
                                       api_factory=lambda: LlmApiDouble("prefill", states))}
    monkeypatch.setattr(trtllm_engine, "make_engine", lambda ctx, cfg, role: engines[role])
    ns = f"t{uuid.uuid4().hex[:8]}"
    stopping = asyncio.Event()
    queue = {"ack_wait_s": 2.0, "storage": "memory"}
    sections = {
        "DecodeWorker": {"engine": "trtllm", "metrics_port": None, "prefill_queue": queue,
                         "disaggregated_router": {"enable": True, "decider": "forced",
                                                  "remote": True}},
        "PrefillWorker": {"engine": "trtllm", "metrics_port": None, "prefill_queue": queue}}

    runtime = make_runtime(asyncio.get_running_loop(), "tcp")

    def ctx(component: str) -> ComponentContext:
        run = ComponentRunConfig(component=component, replica=0,
                                 common=CommonConfig(namespace=ns, model="SmolLM2-135M-Instruct"),
                                 config=sections[component], links=[],
                                 status_file=str(tmp_path / f"{component}.json"))
        return ComponentContext(run=run, runtime=runtime, stopping=stopping)

    contexts = [ctx("PrefillWorker"), ctx("DecodeWorker")]
    mains = [asyncio.create_task(prefill_main.main(contexts[0])),
             asyncio.create_task(decode_main.main(contexts[1]))]
    done: set = set()
    try:
        client = await runtime.endpoint(f"{ns}.decodeworker.generate").client()
        await asyncio.wait_for(client.wait_for_instances(), 10)
        prefill = await runtime.endpoint(f"{ns}.prefillworker.generate").client()
        await asyncio.wait_for(prefill.wait_for_instances(), 10)
        req = worker_request(model=MODEL, token_ids=list(PROMPT), max_tokens=6,
                             temperature=0.0, top_p=None, seed=None, eos_token_ids=[],
                             request_id="p1", priority="default")
        stream = await client.round_robin(req)
        chunks = [chunk_data(c) async for c in stream]
        assert [t for c in chunks for t in c["token_ids"]] == EXPECTED, chunks
        assert states == {}
        assert [c["disaggregated_params"].request_type
                for c in engines["prefill"].api.llm.calls] == ["context_only"]
        assert [c["disaggregated_params"].request_type
                for c in engines["decode"].api.llm.calls] == ["generation_only"]
    finally:
        stopping.set()
        done, pending = await asyncio.wait(mains, timeout=15)
        for t in pending:
            t.cancel()
        await asyncio.gather(*mains, return_exceptions=True)
        runtime.shutdown()
    for t in done:
        assert t.exception() is None, t.exception()


async def test_frontend_answers_503_with_retry_after_for_a_refused_request(
        nats_url: str, smollm2_dir) -> None:
    """The coordinator's refusal chunk becomes HTTP 503 with Retry-After at the frontend."""
    import httpx

    from splitserve.components.frontend.app import FrontendState, build_app
    from splitserve.components.frontend.textcodec import TextCodec

    dec = await sglang("decode", BootstrapRooms())
    async with Rig(nats_url, dec, remote=True, live=0, retry_after_s=3.0,
                   no_prefill_worker_wait_s=0.2) as rig:

        class CoordinatorBackend:
            def ready(self) -> bool:
                return True

            def stream(self, call, meta, context):
                return rig.coord.generate(call.to_wire())

        state = FrontendState(model_name="SmolLM2-135M-Instruct",
                              codec=TextCodec.from_dir(smollm2_dir),
                              backend=CoordinatorBackend())
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hi"}]}
            for stream in (False, True):
                r = await client.post("/v1/chat/completions", json={**body, "stream": stream})
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "3"
                assert r.json()["error"]["code"] == "worker_overloaded"


async def test_client_gone_before_the_prefill_abandons_the_job(nats_url: str) -> None:
    """A request cancelled while its job waits in the queue: the prefill worker that pulls
    it later finds nobody waiting, acks it and aborts the SGLang prefill it began."""
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    async with Rig(nats_url, dec, remote=True) as rig:
        serving = asyncio.create_task(tokens(rig.coord, "r10"))
        for _ in range(40):
            if (await rig.queue.depth()).total:
                break
            await asyncio.sleep(0.05)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        assert rig.coord.inflight == 0
        await rig.start_prefill(pre)
        for _ in range(100):
            if rig.jobs("orphaned"):
                break
            await asyncio.sleep(0.05)
        assert rig.jobs("orphaned") == 1
        # its first delivery's id (``engine_request_id``), as SGLang knows it
        assert any(a.startswith("r10@") and a.endswith(".1$")
                   for a in double_of(pre).aborted), double_of(pre).aborted
        assert pre.inflight() == 0
        assert (await rig.queue.depth()).total == 0


async def test_engine_failure_is_an_error_chunk(nats_url: str) -> None:
    """An engine that refuses the handoff (a TensorRT-LLM decode engine whose context
    state is gone) ends the request with an error chunk, not a broken stream."""
    states: dict = {}
    dec, pre = await trtllm("decode", states), await trtllm("prefill", states)
    async with Rig(nats_url, dec, remote=True) as rig:
        await rig.start_prefill(pre)
        original = pre.prefill

        async def prefill_then_lose_state(rid, params):
            result = await original(rid, params)
            states.clear()  # the context server restarted: its state is gone
            return result

        pre.prefill = prefill_then_lose_state
        req = worker_request(model=MODEL, token_ids=list(PROMPT), max_tokens=4,
                             temperature=0.0, top_p=None, seed=None, eos_token_ids=[],
                             request_id="e1", priority="default")
        chunks = [c async for c in rig.coord.generate(req)]
        assert chunks[-1]["finish_reason"] == "error" and "trtllm engine" in chunks[-1]["error"]
        assert "retry_after_s" not in chunks[-1] and rig.coord.inflight == 0
