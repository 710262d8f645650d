"""The TensorRT-LLM adapter's protocol against an LLM double that enforces its rules:
context_only -> opaque disaggregated_params -> generation_only (once, same prompt);
context_and_generation for local prefill; cumulative outputs; abort."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.engine import (
    GenerateParams,
    OpaqueHandoff,
    PrefillResult,
    SglangBootstrapHandoff,
)
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.engine import TrtllmEngine
from tests.fixtures.engine_doubles import tokens_for
from tests.unit.engines.adapter_helpers import collect, started_trtllm

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

P = GenerateParams(token_ids=(3, 1, 4, 1, 5), max_tokens=7, temperature=0.0)


async def test_disaggregated_equals_aggregated_and_local_prefill():
    states: dict = {}
    agg, pre, dec = await started_trtllm("agg", states), await started_trtllm("prefill", states), await started_trtllm("decode", states)
    expected = await collect(agg.generate("a", P))
    res = await pre.prefill("r", P)
    assert isinstance(res, PrefillResult) and isinstance(res.handoff, OpaqueHandoff)
    # the handoff is JSON-able: it crosses processes in the prefill job's reply
    wire = OpaqueHandoff.model_validate_json(res.handoff.model_dump_json())
    got = await collect(dec.decode("r", P, wire))
    assert got == expected == tokens_for(list(P.token_ids), 7)
    assert res.first_token == got[0]
    sent = dec.llm.calls[-1]["disaggregated_params"]
    assert sent.request_type == "generation_only" and isinstance(sent.opaque_state, bytes)
    # local prefill on the decode engine: context_and_generation, same tokens
    assert dec.info.capabilities.local_prefill
    assert await collect(dec.generate("l", P)) == expected
    assert dec.llm.calls[-1]["disaggregated_params"].request_type == "context_and_generation"
    assert pre.llm.calls[-1]["sampling_params"].max_tokens == 1
    assert pre.llm.calls[-1]["disaggregated_params"].request_type == "context_only"


async def test_opaque_state_is_used_once():
    states: dict = {}
    pre, dec = await started_trtllm("prefill", states), await started_trtllm("decode", states)
    res = await pre.prefill("r", P)
    await collect(dec.decode("r", P, res.handoff))
    with pytest.raises(ValueError, match="context state"):
        await collect(dec.decode("r2", P, res.handoff))


async def test_roles_refuse_what_they_cannot_do():
    states: dict = {}
    pre, dec = await started_trtllm("prefill", states), await started_trtllm("decode", states)
    assert not pre.info.capabilities.local_prefill
    with pytest.raises(RuntimeError):
        pre.generate("x", P)
    with pytest.raises(TypeError):
        dec.decode("x", P, SglangBootstrapHandoff(bootstrap_host="h", bootstrap_port=1,
                                                  bootstrap_room=1))
    with pytest.raises(ValueError, match="context phase"):
        dec.decode("x", P, OpaqueHandoff(disaggregated_params=None))


async def test_cancellation_aborts_the_generation_result():
    states: dict = {}
    agg = await started_trtllm("agg", states)
    it = agg.generate("c", GenerateParams(token_ids=(1,), max_tokens=500))
    await it.__anext__()
    await it.aclose()
    assert agg.llm.aborted and agg.inflight() == 0


async def test_drain_then_abort():
    states: dict = {}
    agg = await started_trtllm("agg", states)
    llm = agg.llm
    task = asyncio.ensure_future(collect(agg.generate("s", P)))
    await asyncio.sleep(0)
    long = agg.generate("l", GenerateParams(token_ids=(1,), max_tokens=100_000))
    await long.__anext__()
    await agg.shutdown(drain_timeout_s=0.2)
    assert await task == tokens_for(list(P.token_ids), 7)
    assert llm.aborted  # the long one was aborted after the drain window


async def test_kv_events_and_stats_become_project_types():
    states: dict = {}
    agg = await started_trtllm("agg", states)
    bs = agg.args.tokens_per_block
    await collect(agg.generate("first", P))  # TensorRT-LLM's queues exist from here
    agg.llm.events.append({"event_id": 1, "data": {"type": "stored", "parent_hash": None,
                           "blocks": [{"block_hash": 11, "tokens": [{"token_id": t} for t in range(bs)]}]}})
    agg.llm.stats.append({"numActiveRequests": 3, "numQueuedRequests": 1,
                          "kvCacheStats": {"usedNumBlocks": 5, "maxNumBlocks": 100}})
    got: list = []
    task = asyncio.ensure_future(agg.run_kv_events(got.extend))
    for _ in range(100):
        await asyncio.sleep(0.02)
        if got and agg.load().active == 3:
            break
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert got[0].block_hashes == (11,) and got[0].token_ids == tuple(range(bs))
    ld = agg.load()
    assert (ld.active, ld.waiting, ld.kv_used_blocks, ld.kv_total_blocks) == (3, 1, 5, 100)
    await agg.shutdown()


async def test_both_adapters_implement_the_engine_protocol():
    from splitserve.contracts.engine import Engine
    from splitserve.components.engines.sglang.config import SglangEngineArgs
    from splitserve.components.engines.sglang.engine import SglangEngine

    args = SglangEngineArgs.model_construct(**{
        k: f.default for k, f in SglangEngineArgs.model_fields.items()
        if k != "extra_server_args"}, extra_server_args={})
    assert isinstance(SglangEngine(args, "m"), Engine)
    assert isinstance(TrtllmEngine(TrtllmEngineArgs(), "m"), Engine)
