"""The decode coordinator's steps for SGLang and TensorRT-LLM, played against the engine
doubles with the pure offload rule: verdict -> plan -> remote prefill or local, bounded
waits, failures, cancellation.  (The coordinator loop itself lives in the worker.)"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.engines.sglang.requests import sglang_rid
from splitserve.contracts.engine import GenerateParams
from splitserve.components.engines.sglang.config import SglangEngineArgs
from splitserve.components.engines.sglang.engine import SglangEngine
from splitserve.components.worker.offload import (
    plan_after_remote_failure,
    plan_offload,
)
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from tests.fixtures.engine_doubles import (
    BootstrapRooms,
    LlmApiDouble,
    SglangEngineDouble,
    tokens_for,
)
from tests.unit.engines.adapter_helpers import collect

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

P = GenerateParams(token_ids=(9, 8, 7), max_tokens=5, temperature=0.0)
ARGS = SglangEngineArgs.model_construct(**{
    k: f.default for k, f in SglangEngineArgs.model_fields.items() if k != "extra_server_args"},
    extra_server_args={})


async def sglang(role, rooms) -> SglangEngine:
    e = SglangEngine(ARGS, "m", role, factory=lambda **a: SglangEngineDouble(rooms, **a))
    await e.start()
    return e


async def serve(decode_engine, prefill_engine, verdict_remote, live_prefill, *,
                max_wait_s=0.3, timeout_s=1.0):
    """One request through the coordinator's steps; returns (outcome, tokens|plan)."""
    local = decode_engine.info.capabilities.local_prefill
    waited = 0.0
    while True:
        plan = plan_offload(verdict_remote, "verdict", supports_local_prefill=local,
                            live_prefill_workers=live_prefill(), waited_s=waited,
                            max_wait_s=max_wait_s, retry_after_s=2.0, poll_s=0.05)
        if plan.action != "wait":
            break
        await asyncio.sleep(plan.wait_s)
        waited += plan.wait_s
    if plan.action == "reject":
        return "503", plan
    if plan.action == "local":
        return "local", await collect(decode_engine.generate("q", P))
    try:
        if isinstance(prefill_engine, SglangEngine):
            ticket = await prefill_engine.begin_prefill("q", P)
            handoff = ticket.handoff
        else:
            handoff = (await asyncio.wait_for(prefill_engine.prefill("q", P), timeout_s)).handoff
        tokens = await asyncio.wait_for(collect(decode_engine.decode("q", P, handoff)), timeout_s)
        return plan.reason, tokens
    except TimeoutError:
        after = plan_after_remote_failure("timeout", supports_local_prefill=local,
                                          retry_after_s=2.0)
        if after.action == "local":
            return "local-after-timeout", await collect(decode_engine.generate("q2", P))
        return "503", after


async def test_sglang_local_verdict_is_served_remotely():
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    outcome, tokens = await serve(dec, pre, False, lambda: 1)
    assert outcome == "engine-no-local-prefill" and tokens == tokens_for([9, 8, 7], 5)


async def test_sglang_without_prefill_workers_gets_503_after_a_bounded_wait():
    rooms = BootstrapRooms()
    dec = await sglang("decode", rooms)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    outcome, plan = await serve(dec, None, True, lambda: 0, max_wait_s=0.3)
    assert outcome == "503" and plan.retry_after_s == 2.0 and plan.reason == "no-prefill-worker"
    assert 0.25 <= loop.time() - t0 < 2.0
    assert dec._engine.calls == []


async def test_sglang_prefill_worker_appearing_during_the_wait_serves_the_request():
    rooms = BootstrapRooms()
    dec, pre = await sglang("decode", rooms), await sglang("prefill", rooms)
    loop = asyncio.get_running_loop()
    start = loop.time()
    outcome, tokens = await serve(dec, pre, True, lambda: int(loop.time() - start > 0.1),
                                  max_wait_s=2.0)
    assert outcome == "verdict" and tokens == tokens_for([9, 8, 7], 5)


async def test_sglang_decode_timeout_ends_in_503_and_aborts():
    rooms = BootstrapRooms()
    dec = await sglang("decode", rooms)

    class SilentPrefill(SglangEngine):  # hands out a room but never submits a prefill
        async def begin_prefill(self, request_id, params):
            from splitserve.contracts.engine import SglangBootstrapHandoff
            from splitserve.components.engines.sglang.engine import PrefillTicket

            return PrefillTicket(SglangBootstrapHandoff(bootstrap_host="127.0.0.1",
                                                        bootstrap_port=1, bootstrap_room=7),
                                 asyncio.ensure_future(asyncio.sleep(0)))

    silent = SilentPrefill(ARGS, "m", "prefill")
    outcome, plan = await serve(dec, silent, True, lambda: 1, timeout_s=0.3)
    assert outcome == "503" and plan.reason == "timeout"
    assert sglang_rid("q") in dec._engine.aborted and dec.inflight() == 0


async def test_trtllm_timeout_falls_back_to_context_and_generation():
    states: dict = {}

    class StuckPrefill(TrtllmEngine):
        async def prefill(self, request_id, params):
            await asyncio.sleep(10)

    dec = TrtllmEngine(TrtllmEngineArgs(), "m", "decode",
                       api_factory=lambda: LlmApiDouble("decode", states))
    await dec.start()
    outcome, tokens = await serve(dec, StuckPrefill(TrtllmEngineArgs(), "m", "prefill"),
                                  True, lambda: 1, timeout_s=0.3)
    assert outcome == "local-after-timeout" and tokens == tokens_for([9, 8, 7], 5)
    assert dec.llm.calls[-1]["disaggregated_params"].request_type == "context_and_generation"
