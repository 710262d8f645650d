"""The sampling and log-probability parameters through a live aggregated torch graph,
driven with the official ``openai`` client (its types parse every response)."""

from __future__ import annotations

import json
import math

import openai
import pytest


pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def c(agg_torch):
    with openai.OpenAI(base_url=f"{agg_torch[1]}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


def greedy(c, max_tokens: int = 8, **kw):
    return c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                     max_tokens=max_tokens, **kw)


def test_n_two_choices_streamed_and_not(c):
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=6,
                                  temperature=1.0, seed=4)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.message.content for ch in r.choices)
    again = c.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=6,
                                      temperature=1.0, seed=4)
    assert [ch.message.content for ch in again.choices] == [ch.message.content
                                                            for ch in r.choices]
    texts = {0: "", 1: ""}
    for chunk in c.chat.completions.create(model=MODEL, messages=QUESTION, n=2, max_tokens=6,
                                           temperature=0, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == texts[1] == greedy(c, max_tokens=6).choices[0].message.content


def test_chat_logprobs_streamed_and_not(c):
    r = greedy(c, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-4)
    streamed = [t for chunk in greedy(c, logprobs=True, top_logprobs=2, stream=True)
                for ch in chunk.choices if ch.logprobs for t in ch.logprobs.content or []]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content],
                                                          abs=1e-4)


def test_completion_logprobs_with_echo(c):
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                             temperature=0, logprobs=1, echo=True)
    ch = r.choices[0]
    assert ch.text.startswith("The capital of France is")
    lp = ch.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == len(lp.tokens)


def test_penalties_change_a_repetitive_answer(c):
    ask = [{"role": "user", "content": "Repeat the word cat ten times."}]
    plain = c.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=16)
    penalised = c.chat.completions.create(model=MODEL, messages=ask, temperature=0,
                                          max_tokens=16, presence_penalty=2.0,
                                          frequency_penalty=2.0)
    words = [w.strip(".,!") for w in plain.choices[0].message.content.lower().split()]
    assert words.count("cat") >= 2, plain.choices[0].message.content
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_min_tokens_and_logit_bias(c):
    base = greedy(c, logprobs=True)
    assert base.usage.completion_tokens < 30
    long = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                     max_tokens=40, extra_body={"min_tokens": 30})
    assert long.usage.completion_tokens >= 30
    # ban the greedy answer's first token: it never appears, there or later
    first = base.choices[0].logprobs.content[0].token
    banned = greedy(c, logprobs=True, logit_bias={str(i): -100 for i in token_ids(first)})
    assert first not in [t.token for t in banned.choices[0].logprobs.content]


def token_ids(text: str) -> list[int]:
    """The served tokenizer's ids for ``text`` (the frontend's own model directory)."""
    from transformers import AutoTokenizer

    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import export_model_dir, served_model_name

    tok = AutoTokenizer.from_pretrained(str(export_model_dir(model_cache_dir(
        served_model_name()))))
    return tok.encode(text, add_special_tokens=False)


def test_stop_strings_and_stream_usage(c):
    full = greedy(c, max_tokens=12).choices[0].message.content
    cut = greedy(c, max_tokens=12, stop=["France"]).choices[0]
    assert "France" in full and "France" not in cut.message.content
    assert full.startswith(cut.message.content) and cut.finish_reason == "stop"
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=5))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_structured_output_parses_into_a_pydantic_model(c):
    import pydantic

    class Capital(pydantic.BaseModel):
        country: str = pydantic.Field(max_length=20)
        city: str = pydantic.Field(max_length=20)

    r = c.chat.completions.parse(model=MODEL, messages=QUESTION, temperature=0,
                                 max_tokens=48, response_format=Capital)
    answer = r.choices[0].message.parsed
    assert isinstance(answer, Capital) and r.choices[0].finish_reason == "stop"
    loose = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                      max_tokens=48, response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)
