"""Sampling parameters through the engine core with the real model: log-probabilities
equal the log-softmax of the reference forward pass, prompt log-probabilities survive a
prefix-cache hit, and asking for them does not change the greedy answer."""

from __future__ import annotations

import pytest
import torch

from splitserve.components.engines.torch_cpu import Request
from splitserve.components.engines.torch_cpu.model import score_prompt

pytestmark = pytest.mark.unit

PROMPT = (1, 504, 3458, 282, 4649, 314, 2, 198, 1, 4093, 198)


def run(engine, req: Request):
    engine.add_request(req)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_logprobs_match_the_reference_and_leave_greedy_unchanged(make_engine, smollm2):
    engine = make_engine()
    plain = tokens(run(engine, Request("a", PROMPT, max_tokens=6)))
    outs = run(engine, Request("b", PROMPT, max_tokens=6, logprobs=3, prompt_logprobs=2))
    assert tokens(outs) == plain
    lps = [x for o in outs for x in o.logprobs]
    tops = [x for o in outs for x in o.top_logprobs]
    ref = torch.log_softmax(score_prompt(smollm2.weights, smollm2.config,
                                         list(PROMPT) + plain[:-1]).float(), dim=-1)
    n = len(PROMPT)
    for i, tok in enumerate(plain):
        assert lps[i] == pytest.approx(float(ref[n - 1 + i, tok]), abs=1e-3)
        assert [t for t, _ in tops[i]] == torch.topk(ref[n - 1 + i], 3).indices.tolist()
    # prompt log-probabilities on the first output, although the prompt was cached
    prompt_lps = outs[0].prompt_logprobs
    assert len(prompt_lps) == n - 1
    expected = [float(ref[i, PROMPT[i + 1]]) for i in range(n - 1)]
    assert list(prompt_lps) == pytest.approx(expected, abs=1e-3)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_banned_token_and_min_tokens_hold_through_the_engine(make_engine):
    engine = make_engine()
    plain = tokens(run(engine, Request("a", PROMPT, max_tokens=4)))
    banned = plain[0]
    outs = run(engine, Request("b", PROMPT, max_tokens=4, logit_bias=((banned, -100.0),)))
    assert banned not in tokens(outs)
    eos = engine.model_config.eos_token_ids
    long = tokens(run(engine, Request("c", PROMPT, max_tokens=12, min_tokens=10,
                                      temperature=1.0, seed=3)))
    assert len(long) >= 10 and not set(long[:10]) & set(eos)


def test_a_json_schema_answer_parses_and_validates(smollm2):
    import json

    from splitserve.components.engines.torch_cpu import EngineConfig, EngineCore
    from splitserve.components.engines.torch_cpu.grammar import JsonGrammars

    engine = EngineCore(smollm2.weights, smollm2.config, EngineConfig(num_blocks=64),
                        grammars=JsonGrammars(smollm2.tokenizer, smollm2.config.vocab_size))
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    outs = run(engine, Request("j", PROMPT, max_tokens=40, json_schema=json.dumps(schema)))
    assert outs[-1].finish_reason == "stop"
    ids = [t for t in tokens(outs) if t not in smollm2.config.eos_token_ids]
    value = json.loads(smollm2.tokenizer.decode(ids))
    assert set(value) == {"answer"} and isinstance(value["answer"], str)
    # the plain answer to the same prompt is not JSON: the mask did the work
    plain = tokens(run(engine, Request("p", PROMPT, max_tokens=8)))
    assert smollm2.tokenizer.decode(plain)[:1] != "{"
