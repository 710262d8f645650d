"""Each engine gets a request's priority level (``contracts/priority.py``: 0 is the most
important class) in its own scheduler's convention, and on every path (aggregated,
prefill, decode): the torch core serves higher values first, vLLM lower values first,
SGLang higher values first unless told otherwise, and only when it schedules by
priority.  vLLM's and SGLang's calls are bound against the installed signatures."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest

from splitserve.contracts.engine import GenerateParams, SglangBootstrapHandoff
from tests.unit.engines.adapter_helpers import deltas

pytestmark = pytest.mark.unit

LEVELS = [0, 1, 2, 3]  # 3: a fourth class (say `batch` below `low`)
P = GenerateParams(token_ids=(5, 6, 7, 8), max_tokens=3, temperature=0.0)


# ---- torch: the core serves higher priorities first -------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_torch_core_gets_the_level_negated(level):
    from splitserve.components.engines.torch_cpu.adapter import torch_request

    req = torch_request("r", dataclasses.replace(P, priority=level))
    assert req.priority == -level


def test_torch_scheduler_serves_the_levels_in_order():
    from splitserve.components.engines.torch_cpu.adapter import torch_request
    from splitserve.components.engines.torch_cpu.scheduler import _rank

    arrived = [3, 1, 0, 2, 1]  # levels, in arrival order
    seqs = [SimpleNamespace(request=torch_request(f"{i}@{lvl}",
                                                  dataclasses.replace(P, priority=lvl)),
                            arrival=i) for i, lvl in enumerate(arrived)]
    order = [s.request.request_id for s in sorted(seqs, key=_rank)]
    assert order == ["2@0", "1@1", "4@1", "3@2", "0@3"]  # by level, then arrival


# ---- vLLM: lower values first (--scheduling-policy priority) ----------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_vllm_gets_the_level_as_is_and_the_call_binds(level):
    from vllm.v1.engine.async_llm import AsyncLLM

    from splitserve.components.engines.vllm.requests import (
        generate_kwargs,
        prompt,
        sampling_params,
    )

    p = dataclasses.replace(P, priority=level)
    kw = generate_kwargs("r", p)
    assert kw == {"request_id": "r", "priority": level}
    inspect.signature(AsyncLLM.generate).bind(object(), prompt(p), sampling_params(p), **kw)


def test_vllms_priority_policy_serves_lower_values_first_and_is_configurable():
    from vllm.config.scheduler import SchedulerConfig

    from splitserve.components.engines.vllm.config import VllmEngineArgs, engine_arg_names

    doc = inspect.getsource(SchedulerConfig)
    assert '"priority" means requests are handled based on given priority (lower' in doc
    assert "value means earlier handling)" in doc
    assert "scheduling_policy" in engine_arg_names()
    args = VllmEngineArgs(extra_engine_args={"scheduling_policy": "priority"})
    assert args.extra_engine_args == {"scheduling_policy": "priority"}


class _AsyncLlm:
    """``AsyncLLM.generate`` as the adapter calls it: records each call's keywords and
    answers one finished output (with ``kv_transfer_params`` for a prefill)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def generate(self, prompt, sampling_params, **kw):
        from vllm.outputs import CompletionOutput, RequestOutput

        inspect.signature(_real_generate()).bind(object(), prompt, sampling_params, **kw)
        self.calls.append(kw)
        comp = CompletionOutput(index=0, text="", token_ids=[9], cumulative_logprob=None,
                                logprobs=None, finish_reason="length")
        yield RequestOutput(request_id=kw["request_id"], prompt=None,
                            prompt_token_ids=list(prompt["prompt_token_ids"]),
                            prompt_logprobs=None, outputs=[comp], finished=True,
                            kv_transfer_params={"remote_engine_id": "e"})

    async def abort(self, request_id) -> None:
        pass


def _real_generate():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.generate


@pytest.mark.asyncio
@pytest.mark.parametrize("level", [0, 3])
async def test_every_vllm_path_passes_the_level(level):
    from splitserve.components.engines.vllm.config import VllmEngineArgs, VllmKvTransfer
    from splitserve.components.engines.vllm.engine import VllmEngine

    p = dataclasses.replace(P, priority=level)
    args = VllmEngineArgs(kv_events=False)
    agg = VllmEngine(args, "m")
    pre = VllmEngine(args, "m", "prefill", kv_transfer=VllmKvTransfer())
    for e in (agg, pre):
        e._engine = _AsyncLlm()
    await deltas(agg.generate("a", p))
    result = await pre.prefill("p", p)
    dec = VllmEngine(args, "m", "decode", kv_transfer=VllmKvTransfer())
    dec._engine = _AsyncLlm()
    await deltas(dec.decode("d", p, result.handoff))
    assert [c["priority"] for e in (agg, pre, dec) for c in e._engine.calls] == [level] * 3


# ---- SGLang: higher values first by default, only when it schedules by priority --------

def _sglang_args(**server_args):
    from splitserve.components.engines.sglang.config import SglangEngineArgs

    return SglangEngineArgs.model_construct(**{
        k: f.default for k, f in SglangEngineArgs.model_fields.items()
        if k != "extra_server_args"}, extra_server_args=server_args)


SGLANG = {
    # case: (server args, level, SGLang's priority: None = not sent)
    "off": ({}, 2, None),
    "on: level 0": ({"enable_priority_scheduling": True}, 0, 0),
    "on: level 3": ({"enable_priority_scheduling": True}, 3, -3),
    "on, low values first: level 3": ({"enable_priority_scheduling": True,
                                       "schedule_low_priority_values_first": True}, 3, 3),
}


@pytest.mark.asyncio
@pytest.mark.parametrize(("server_args", "level", "sent"), SGLANG.values(), ids=SGLANG.keys())
async def test_every_sglang_path_passes_the_level_in_sglangs_convention(server_args, level,
                                                                        sent):
    import asyncio

    from splitserve.components.engines.sglang.engine import SglangEngine
    from tests.fixtures.engine_doubles import BootstrapRooms, SglangEngineDouble

    rooms = BootstrapRooms()
    args = _sglang_args(**server_args)

    async def make(role):
        eng = SglangEngine(args, "m", role,
                           factory=lambda **a: SglangEngineDouble(rooms, **a))
        await eng.start()
        return eng

    p = dataclasses.replace(P, priority=level)
    agg, pre, dec = await make("agg"), await make("prefill"), await make("decode")
    await deltas(agg.generate("a", p))
    ticket = await pre.begin_prefill("r", p)
    assert isinstance(ticket.handoff, SglangBootstrapHandoff)
    await deltas(dec.decode("r", p, ticket.handoff))
    await asyncio.wait_for(ticket.result, 5)
    sentinel = object()
    got = [c.get("priority", sentinel) for e in (agg, pre, dec) for c in e._engine.calls]
    assert got == [sent] * 3
