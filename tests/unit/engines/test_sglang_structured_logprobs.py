"""Structured output and log-probabilities through the SGLang adapter: the schema in
SGLang's own sampling-params field, the logprob arguments of ``async_generate``, and
SGLang's cumulative logprob lists turned into one run per delta."""

from __future__ import annotations

import json

import pytest

from splitserve.contracts.engine import GenerateParams, SglangBootstrapHandoff
from splitserve.components.engines.sglang.config import SglangEngineArgs
from splitserve.components.engines.sglang.engine import SchemaNeedsGrammar, SglangEngine
from splitserve.components.engines.sglang.requests import (
    LogprobReader,
    generate_kwargs,
    sampling_params,
)
from tests.fixtures.engine_doubles import BootstrapRooms, SglangEngineDouble, tokens_for
from tests.unit.engines.adapter_helpers import deltas
from tests.unit.engines.upstream import sglang_module, sglang_source

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}},
                    sort_keys=True)
P = GenerateParams(token_ids=(5, 6, 7, 8), max_tokens=4, temperature=0.0)


def args(**kw) -> SglangEngineArgs:
    fields = {k: f.default for k, f in SglangEngineArgs.model_fields.items()
              if k != "extra_server_args"}
    return SglangEngineArgs.model_construct(**{**fields, **kw}, extra_server_args={})


async def started(a: SglangEngineArgs, role: str = "agg"
                  ) -> tuple[SglangEngine, list[SglangEngineDouble]]:
    """A started adapter and the list its double lands in (to read the calls)."""
    rooms, built = BootstrapRooms(), []

    def factory(**kw):
        built.append(SglangEngineDouble(rooms, **kw))
        return built[-1]

    eng = SglangEngine(a, "m", role, factory=factory)
    await eng.start()
    return eng, built


async def test_the_schema_is_sglangs_json_schema_field_and_its_params_accept_it():
    sp = sampling_params(GenerateParams(token_ids=(1,), json_schema=SCHEMA))
    assert sp["json_schema"] == SCHEMA
    assert "json_schema" not in sampling_params(P)
    real = sglang_module("sglang.srt.sampling.sampling_params").SamplingParams(**sp)
    assert real.json_schema == SCHEMA and real.regex is None


@pytest.mark.parametrize(("logprobs", "prompt", "expected"), [
    (None, None, {}),
    (0, None, {"return_logprob": True, "top_logprobs_num": 0}),
    (3, None, {"return_logprob": True, "top_logprobs_num": 3}),
    (1, 4, {"return_logprob": True, "top_logprobs_num": 4, "logprob_start_len": 0}),
    (None, 0, {"return_logprob": True, "top_logprobs_num": 0, "logprob_start_len": 0}),
])
async def test_logprob_arguments_of_async_generate(logprobs, prompt, expected):
    kw = generate_kwargs("r", GenerateParams(token_ids=(1, 2), logprobs=logprobs,
                                             prompt_logprobs=prompt))
    assert {k: kw[k] for k in kw if "logprob" in k} == expected


async def test_sglang_streams_each_chunks_own_output_logprobs():
    """The installed SGLang slices the output logprobs to the chunk's tokens when it
    streams incrementally (round 2, finding 2: the reader assumed running totals and
    raised on the second chunk)."""
    src = sglang_source("srt/managers/tokenizer_manager.py")
    keys = src.after("_INCREMENTAL_STREAMING_META_INFO_KEYS = (", 200)
    assert '"output_token_logprobs"' in keys and '"output_top_logprobs"' in keys
    assert "meta_info[key] = meta_info[key][last_output_offset:]" in src.text


async def test_the_reader_takes_each_chunks_own_logprobs():
    reader = LogprobReader(top_n=1, prompt_top_n=None)
    first = {"output_token_logprobs": [(-0.1, 7, None)],
             "output_top_logprobs": [[(-0.1, 7, None), (-2.0, 9, None)]]}
    assert reader.read(first, 1)["logprobs"].model_dump() == {
        "logprobs": [-0.1], "top": [[(7, -0.1)]]}
    second = {"output_token_logprobs": [(-0.3, 8, None), (-0.2, 4, None)],
              "output_top_logprobs": [[(-0.3, 8, None)], [(-0.2, 4, None)]]}
    run = reader.read(second, 2)["logprobs"]
    assert run.logprobs == [-0.3, -0.2] and run.top == [[(8, -0.3)], [(4, -0.2)]]
    with pytest.raises(RuntimeError):  # a chunk whose logprobs do not match its tokens
        reader.read(second, 1)


async def test_logprobs_stream_one_run_per_delta_with_the_prompts_once():
    eng, built = await started(args())
    p = GenerateParams(token_ids=P.token_ids, max_tokens=4, logprobs=2, prompt_logprobs=1)
    got = await deltas(eng.generate("r", p))
    toks = tokens_for(list(p.token_ids), 4)
    assert [t for d in got for t in d.token_ids] == toks
    assert all(d.logprobs is not None and len(d.logprobs.logprobs) == len(d.token_ids)
               for d in got)
    tops = [top for d in got for top in d.logprobs.top]
    assert tops == [[(t, -0.5), (t + 1000, -1.5)] for t in toks]
    assert got[0].prompt_logprobs.logprobs == [-1.5] * 3  # the first prompt token has none
    assert got[0].prompt_logprobs.top == [[(t, -1.5)] for t in p.token_ids[1:]]
    assert all(d.prompt_logprobs is None for d in got[1:])
    call = built[0].calls[-1]
    assert (call["return_logprob"], call["top_logprobs_num"], call["logprob_start_len"]) == (
        True, 2, 0)
    await eng.shutdown()


async def test_a_request_without_logprobs_gets_none():
    eng, built = await started(args())
    got = await deltas(eng.generate("r", P))
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in got)
    assert built[0].calls[-1]["return_logprob"] is False
    await eng.shutdown()


async def test_a_schema_reaches_sglang_when_its_grammar_backend_runs():
    eng, built = await started(args())
    assert not eng.server_kwargs()["skip_tokenizer_init"]
    p = GenerateParams(token_ids=P.token_ids, max_tokens=4, json_schema=SCHEMA)
    got = await deltas(eng.generate("r", p))
    assert got[-1].finish_reason == "length"
    assert built[0].calls[-1]["sampling_params"]["json_schema"] == SCHEMA
    await eng.shutdown()


async def test_without_structured_output_a_schema_is_refused_before_sglang_sees_it():
    eng, built = await started(args(structured_output=False))
    p = GenerateParams(token_ids=P.token_ids, json_schema=SCHEMA)
    with pytest.raises(SchemaNeedsGrammar, match="structured_output"):
        eng.validate(p)
    with pytest.raises(SchemaNeedsGrammar):
        eng.generate("r", p)
    assert built[0].calls == []
    await eng.shutdown()


async def test_the_double_aborts_a_schema_when_sglang_has_no_tokenizer():
    # what the refusal above saves the client from: SGLang's abort of the request
    double = SglangEngineDouble(BootstrapRooms(), skip_tokenizer_init=True)
    gen = await double.async_generate(input_ids=[1, 2], stream=True, rid="r", sampling_params={
        "max_new_tokens": 2, "json_schema": SCHEMA})
    out = [o async for o in gen]
    assert out[-1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_a_decode_engine_refuses_logprobs_and_schemas_of_a_remote_prefill():
    eng, built = await started(args(), role="decode")
    h = SglangBootstrapHandoff(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=1)
    with pytest.raises(ValueError, match="logprobs"):
        eng.decode("r", GenerateParams(token_ids=(1,), logprobs=0), h)
    with pytest.raises(ValueError, match="response_format"):
        eng.decode("r", GenerateParams(token_ids=(1,), json_schema=SCHEMA), h)
    await eng.shutdown()
