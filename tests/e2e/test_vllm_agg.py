"""vLLM (the CPU build) as the aggregated Worker's engine, through the OpenAI client
(two workers behind the KV-aware router: the package's shared vLLM graph)."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.helpers import scrape
from tests.installed import needs_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.exclusive, needs_vllm]

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)


def gauge(run, name: str) -> float:
    """``name`` summed over the graph's workers."""
    total = 0.0
    for rep in run.replicas("Worker"):
        value = scrape(rep["metrics"]).get(name, {}).get(())
        assert value is not None, f"{name} not exported"
        total += value
    return total


def test_greedy_answer_mentions_paris_streaming_equal(vllm_agg):
    _, url = vllm_agg
    c = client(url)
    r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=32,
                                  messages=QUESTION)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 32
    chunks = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=32, stream=True, messages=QUESTION)
        if ch.choices]
    assert sum(1 for t in chunks if t) > 1  # streamed token by token, not in one piece
    assert "".join(chunks) == r.choices[0].message.content


def test_max_tokens_and_seeded_sampling(vllm_agg):
    _, url = vllm_agg
    c = client(url)
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                             temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    outs = {c.chat.completions.create(
        model=MODEL, temperature=0.9, top_p=0.95, seed=11, max_tokens=12,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}]
    ).choices[0].message.content for _ in range(2)}
    assert len(outs) == 1


def test_cancel_mid_stream_frees_the_engine_request(vllm_agg):
    run, url = vllm_agg
    running = "splitserve_worker_running_requests"
    stream = client(url).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=1500, stream=True,
        messages=[{"role": "user", "content": "Count from 1 to 1000, one number a line."}])
    got = 0
    for ch in stream:
        got += bool(ch.choices and ch.choices[0].delta.content)
        if got >= 5:
            break
    deadline = time.monotonic() + 10
    while gauge(run, running) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauge(run, running) >= 1  # the engine holds the request while it streams
    stream.close()  # the client goes away with ~1,500 tokens (over a minute) still to come
    deadline = time.monotonic() + 20
    while gauge(run, running) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gauge(run, running) == 0
    # and the engine still serves
    r = client(url).chat.completions.create(model=MODEL, temperature=0, max_tokens=16,
                                            messages=QUESTION)
    assert "Paris" in r.choices[0].message.content
