"""Structured output and log-probabilities through the TensorRT-LLM adapter, against
the LLM double: the schema as ``GuidedDecodingParams(json=...)`` on an LLM built with a
guided-decoding backend, ``SamplingParams.logprobs`` and the cumulative
``CompletionOutput.logprobs`` cut into one run per delta."""

from __future__ import annotations

import json

import pytest

from splitserve.contracts.engine import GenerateParams
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs, llm_kwargs
from splitserve.components.engines.trtllm.engine import NotServedHere
from splitserve.components.engines.trtllm.requests import guided_kwargs, sampling_kwargs
from tests.fixtures.engine_doubles import (
    GuidedDecodingParamsDouble,
    LlmDouble,
    SamplingParamsDouble,
    tokens_for,
)
from tests.unit.engines.adapter_helpers import deltas, started_trtllm

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

SCHEMA = json.dumps({"type": "object"}, sort_keys=True)
P = GenerateParams(token_ids=(3, 1, 4, 1, 5), max_tokens=5, temperature=0.0)


@pytest.mark.parametrize(("asked", "sent"), [(None, None), (0, 1), (1, 1), (5, 5)])
async def test_logprobs_count_is_at_least_one(asked, sent):
    kw = sampling_kwargs(GenerateParams(token_ids=(1,), logprobs=asked))
    assert kw.get("logprobs") == sent
    SamplingParamsDouble(**kw)  # every keyword is one SamplingParams has


async def test_the_schema_is_guided_decodings_json():
    assert guided_kwargs(P) is None
    g = GuidedDecodingParamsDouble(**guided_kwargs(GenerateParams(token_ids=(1,),
                                                                  json_schema=SCHEMA)))
    assert g.json == SCHEMA and not g.json_object
    g._validate()  # one guide only


async def test_the_llm_is_built_with_a_guided_decoding_backend_unless_turned_off():
    assert llm_kwargs(TrtllmEngineArgs(), "agg")["guided_decoding_backend"] == "xgrammar"
    off = llm_kwargs(TrtllmEngineArgs(guided_decoding_backend=None), "agg")
    assert "guided_decoding_backend" not in off
    with pytest.raises(ValueError, match="extra_llm_args"):
        TrtllmEngineArgs(extra_llm_args={"guided_decoding_backend": "xgrammar"})


async def test_a_schema_reaches_the_llm_as_guided_decoding():
    eng = await started_trtllm("agg", {})
    got = await deltas(eng.generate("r", GenerateParams(token_ids=P.token_ids, max_tokens=3,
                                                         json_schema=SCHEMA)))
    assert got[-1].finished
    assert eng.llm.calls[-1]["sampling_params"].guided_decoding.json == SCHEMA
    await eng.shutdown()


async def test_without_a_backend_a_schema_is_refused_and_the_llm_would_refuse_it_too():
    eng = await started_trtllm("agg", {}, guided_decoding_backend=None)
    p = GenerateParams(token_ids=P.token_ids, json_schema=SCHEMA)
    with pytest.raises(NotServedHere, match="guided_decoding_backend"):
        eng.validate(p)
    with pytest.raises(NotServedHere):
        eng.generate("r", p)
    assert eng.llm.calls == []
    await eng.shutdown()
    bare = LlmDouble("agg", {})
    sp = SamplingParamsDouble(guided_decoding=GuidedDecodingParamsDouble(json=SCHEMA))
    with pytest.raises(ValueError, match="guided_decoding_backend"):
        bare.generate_async([1, 2], sp)


async def test_logprobs_stream_one_run_per_delta_cut_to_the_requests_count():
    eng = await started_trtllm("agg", {})
    toks = tokens_for(list(P.token_ids), 5)
    for asked, width in ((0, 0), (2, 2)):
        got = await deltas(eng.generate(f"r{asked}", GenerateParams(
            token_ids=P.token_ids, max_tokens=5, logprobs=asked)))
        assert [t for d in got for t in d.token_ids] == toks
        assert all(len(d.logprobs.logprobs) == len(d.token_ids) for d in got)
        assert [lp for d in got for lp in d.logprobs.logprobs] == [-0.25] * 5
        tops = [top for d in got for top in d.logprobs.top]
        assert tops == [[(t, -0.25), (t + 1000, -1.25)][:width] for t in toks]
    plain = await deltas(eng.generate("p", P))
    assert all(d.logprobs is None for d in plain)
    await eng.shutdown()


async def test_prompt_logprobs_are_refused_by_name():
    eng = await started_trtllm("agg", {})
    with pytest.raises(NotServedHere, match="echo"):
        eng.generate("r", GenerateParams(token_ids=P.token_ids, prompt_logprobs=0))
    await eng.shutdown()


async def test_the_doubles_sampling_params_refuse_unknown_keywords_as_upstream():
    with pytest.raises(TypeError):
        SamplingParamsDouble(guided_json=SCHEMA)
    with pytest.raises(ValueError, match="Only one guide"):
        GuidedDecodingParamsDouble(json=SCHEMA, regex="a+")._validate()
