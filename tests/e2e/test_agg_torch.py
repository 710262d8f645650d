"""The README's main graph (graphs.agg with the torch engine) through the OpenAI client."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.e2e.helpers import scrape

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "List two planets of the solar system.",
]


@pytest.fixture(scope="module")
def agg(agg_torch):
    return agg_torch[1]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(c: openai.OpenAI, prompt: str, max_tokens: int = 24) -> str:
    r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens,
                                  messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content


def test_capital_of_france_non_streaming_and_streaming(agg):
    c = client(agg)
    r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=32,
                                  messages=[{"role": "user", "content": PROMPTS[0]}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=32, stream=True,
        messages=[{"role": "user", "content": PROMPTS[0]}]) if ch.choices)
    assert text == r.choices[0].message.content


def test_completions_stop_and_max_tokens(agg):
    c = client(agg)
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                             temperature=0)
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("length", "stop")
    r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=32, stop=["Paris"],
                                  messages=[{"role": "user", "content": PROMPTS[0]}])
    assert "Paris" not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(agg):
    c = client(agg)
    outs = {c.chat.completions.create(model=MODEL, temperature=0.9, top_p=0.95, seed=7,
                                      max_tokens=16, messages=[{"role": "user",
                                                                "content": PROMPTS[2]}]
                                      ).choices[0].message.content for _ in range(2)}
    assert len(outs) == 1


@pytest.mark.deep
def test_32_concurrent_requests_equal_their_sequential_outputs(agg):
    c = client(agg)
    sequential = {p: ask(c, p) for p in PROMPTS}
    work = PROMPTS * 4
    with cf.ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda p: ask(c, p), work))
    assert len(concurrent) == 32
    for p, out in zip(work, concurrent, strict=True):
        assert out == sequential[p], p


@pytest.mark.parametrize("body, status, code", [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model_not_found"),
    ({"model": MODEL, "messages": []}, 400, "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 9000},
     400, "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_value"),
])
def test_bad_input_gets_4xx_and_server_keeps_serving(agg, body, status, code):
    r = httpx.post(f"{agg}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["code"] == code
    r = httpx.post(f"{agg}/v1/chat/completions", content=b"{oops", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "Paris" in ask(client(agg), PROMPTS[0])


def test_health_and_metrics(agg):
    assert httpx.get(f"{agg}/ready").json()["status"] == "ready"
    samples = scrape(f"{agg}/metrics")
    assert "splitserve_frontend_ttft_seconds_bucket" in samples
    assert "splitserve_frontend_itl_seconds_bucket" in samples
