"""SGLang and TensorRT-LLM on a GPU: disaggregated greedy output equals aggregated output
token for token, through this project's adapters (prefill and decode engines in one
process, KV moved by the engines themselves).

Skipped without CUDA, without the engine installed, or without a local model directory
in ``SPLITSERVE_GPU_MODEL`` (GPU machines here have no network).  Three engines share
one GPU, so each takes a small memory fraction.
"""

from __future__ import annotations

import asyncio
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

MODEL = os.environ.get("SPLITSERVE_GPU_MODEL")
if not MODEL:
    pytest.skip("set SPLITSERVE_GPU_MODEL to a local model directory", allow_module_level=True)

from splitserve.components.engines.interface import GenerateParams

PROMPTS = [tuple(range(100, 164)), tuple(range(7, 300, 3))]


async def _collect(it) -> list[int]:
    out: list[int] = []
    async for d in it:
        out += d.token_ids
        if d.finished:
            break
    return out


def _params(tokens) -> GenerateParams:
    return GenerateParams(token_ids=tokens, max_tokens=32, temperature=0.0, ignore_eos=True)


def test_sglang_disaggregated_equals_aggregated():
    pytest.importorskip("sglang")
    from splitserve.components.engines.sglang.config import SglangEngineArgs
    from splitserve.components.engines.sglang.engine import SglangEngine

    args = SglangEngineArgs(model_path=MODEL, mem_fraction_static=0.25, kv_events=False,
                            bootstrap_port=18998)

    async def run():
        agg = SglangEngine(args, "m", "agg")
        pre = SglangEngine(args, "m", "prefill")
        dec = SglangEngine(args, "m", "decode")
        for e in (agg, pre, dec):
            await e.start()
        try:
            for i, tokens in enumerate(PROMPTS):
                expected = await _collect(agg.generate(f"a{i}", _params(tokens)))
                ticket = await pre.begin_prefill(f"d{i}", _params(tokens))
                got = await _collect(dec.decode(f"d{i}", _params(tokens), ticket.handoff))
                first = (await asyncio.wait_for(ticket.result, 60)).first_token
                assert got == expected and first == expected[0]
        finally:
            for e in (agg, pre, dec):
                await e.shutdown()

    asyncio.run(run())


def test_trtllm_disaggregated_equals_aggregated():
    pytest.importorskip("tensorrt_llm")
    from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
    from splitserve.components.engines.trtllm.engine import TrtllmEngine

    args = TrtllmEngineArgs(model=MODEL, free_gpu_memory_fraction=0.25, kv_events=False)

    async def run():
        agg = TrtllmEngine(args, "m", "agg")
        pre = TrtllmEngine(args, "m", "prefill")
        dec = TrtllmEngine(args, "m", "decode")
        for e in (agg, pre, dec):
            await e.start()
        try:
            for i, tokens in enumerate(PROMPTS):
                expected = await _collect(agg.generate(f"a{i}", _params(tokens)))
                res = await pre.prefill(f"p{i}", _params(tokens))
                got = await _collect(dec.decode(f"d{i}", _params(tokens), res.handoff))
                assert got == expected and res.first_token == expected[0]
                local = await _collect(dec.generate(f"l{i}", _params(tokens)))
                assert local == expected  # context_and_generation on the decode engine
        finally:
            for e in (agg, pre, dec):
                await e.shutdown()

    asyncio.run(run())
