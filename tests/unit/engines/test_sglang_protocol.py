"""The SGLang adapter's disaggregation protocol, driven against an in-process double
that enforces SGLang's rules (bootstrap room pairing, no prefill on a decode engine)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.components.engines.sglang.requests import sglang_rid
from splitserve.contracts.engine import (
    GenerateParams,
    OpaqueHandoff,
    SglangBootstrapHandoff,
)
from splitserve.components.engines.sglang.config import SglangEngineArgs
from splitserve.components.engines.sglang.engine import NoLocalPrefill, SglangEngine
from tests.fixtures.engine_doubles import BootstrapRooms, SglangEngineDouble, tokens_for
from tests.unit.engines.adapter_helpers import collect

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

ARGS = SglangEngineArgs.model_construct(**{
    k: f.default for k, f in SglangEngineArgs.model_fields.items() if k != "extra_server_args"},
    extra_server_args={})
PROMPT = GenerateParams(token_ids=(5, 6, 7, 8), max_tokens=6, temperature=0.0)


async def make(role, rooms, **kw) -> SglangEngine:
    eng = SglangEngine(ARGS, "m", role, factory=lambda **a: SglangEngineDouble(rooms, **a), **kw)
    await eng.start()
    return eng


async def test_disaggregated_output_equals_aggregated_token_for_token():
    rooms = BootstrapRooms()
    agg, pre, dec = (await make("agg", rooms), await make("prefill", rooms),
                     await make("decode", rooms))
    expected = await collect(agg.generate("a", PROMPT))
    ticket = await pre.begin_prefill("r1", PROMPT)
    assert isinstance(ticket.handoff, SglangBootstrapHandoff)
    got = await collect(dec.decode("r1", PROMPT, ticket.handoff))
    result = await asyncio.wait_for(ticket.result, 5)
    assert got == expected == tokens_for([5, 6, 7, 8], 6)
    assert result.first_token == got[0] and result.handoff == ticket.handoff
    # the prefill engine was asked for exactly one token under the decode's room
    call = pre._engine.calls[-1]
    assert call["sampling_params"]["max_new_tokens"] == 1
    assert call["bootstrap_room"] == dec._engine.calls[-1]["bootstrap_room"]


async def test_awaiting_the_whole_prefill_before_the_decode_joins_would_hang():
    rooms = BootstrapRooms()
    pre = await make("prefill", rooms)
    assert pre.info.capabilities.handoff_before_prefill is True
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pre.prefill("r", PROMPT), 0.3)


async def test_each_prefill_gets_its_own_room():
    rooms = BootstrapRooms()
    pre = await make("prefill", rooms)
    t1, t2 = await pre.begin_prefill("a", PROMPT), await pre.begin_prefill("b", PROMPT)
    assert t1.handoff.bootstrap_room != t2.handoff.bootstrap_room
    assert (t1.handoff.bootstrap_host, t1.handoff.bootstrap_port) == ("127.0.0.1", 8998)
    await pre.shutdown(0.0)


async def test_decode_engine_cannot_prefill_locally():
    rooms = BootstrapRooms()
    dec = await make("decode", rooms)
    assert dec.info.capabilities.local_prefill is False
    with pytest.raises(NoLocalPrefill):
        dec.generate("x", PROMPT)


async def test_decode_refuses_a_handoff_of_another_engine():
    dec = await make("decode", BootstrapRooms())
    with pytest.raises(TypeError):
        dec.decode("x", PROMPT, OpaqueHandoff(disaggregated_params={}))


async def test_closing_the_stream_aborts_the_request_in_sglang():
    rooms = BootstrapRooms()
    agg = await make("agg", rooms)
    it = agg.generate("gone", GenerateParams(token_ids=(1, 2), max_tokens=50))
    await it.__anext__()
    await it.aclose()
    assert sglang_rid("gone") in agg._engine.aborted and agg.inflight() == 0


async def test_failed_prefill_aborts_and_raises():
    rooms = BootstrapRooms()
    pre = await make("prefill", rooms)
    ticket = await pre.begin_prefill("p", PROMPT)
    await pre.abort("p")
    with pytest.raises(RuntimeError, match="ended with cancelled"):
        await asyncio.wait_for(ticket.result, 5)
    assert pre.inflight() == 0


async def test_shutdown_drains_then_aborts_the_rest():
    rooms = BootstrapRooms()
    agg = await make("agg", rooms)
    short = asyncio.ensure_future(collect(agg.generate("s", PROMPT)))
    await asyncio.sleep(0)
    await agg.shutdown(drain_timeout_s=5.0)
    assert (await short) == tokens_for([5, 6, 7, 8], 6)  # finished during the drain
    agg2 = await make("agg", rooms)
    double = agg2._engine
    it = agg2.generate("long", GenerateParams(token_ids=(1,), max_tokens=10_000))
    await it.__anext__()
    await agg2.shutdown(drain_timeout_s=0.05)
    assert sglang_rid("long") in double.aborted and double.shut
    with pytest.raises(RuntimeError, match="not accepting"):
        await agg2.generate("late", PROMPT).__anext__()
