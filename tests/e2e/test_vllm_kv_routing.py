"""vLLM's KV events reach the router's prefix index: with two vLLM workers behind the
KV-aware router, a request sharing a long prefix goes to the worker that holds it."""

from __future__ import annotations

import time

import openai
import pytest

from tests.graphs import route_explain
from tests.e2e.helpers import metric, scrape
from tests.installed import needs_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.exclusive, needs_vllm]

MODEL = "SmolLM2-135M-Instruct"
# About 400 tokens: three full blocks of vLLM's 128 (only full blocks become events).
LONG = ("You are reviewing a long design document about a distributed cache. " * 30
        + "Summarise it in one sentence.")


def test_long_prefix_follows_the_worker_holding_it(vllm_agg):
    run, url = vllm_agg  # configs/vllm_agg_router.yaml: two workers, the KV-aware router
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                      timeout=180)
    msgs = [{"role": "user", "content": LONG}]
    first = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                      messages=msgs)
    holder, d = None, {}
    deadline = time.monotonic() + 30  # KV events reach the router asynchronously
    while time.monotonic() < deadline:
        d = route_explain(run, LONG, timeout_s=120)
        overlap = {int(k): v for k, v in d["decision"]["scorers"][0]["raw"].items()}
        if max(overlap.values(), default=0) > 0.5:
            holder = d["worker_id"]
            break
        time.sleep(1)
    assert holder is not None, d
    assert overlap[holder] > 0.5 and min(overlap.values()) == 0.0, d
    router_metrics = next(r["metrics"] for r in run.replicas("Router"))
    decisions = "splitserve_router_decisions_total"
    before = metric(router_metrics, decisions, worker=f"{holder:x}")
    for _ in range(2):
        again = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                          messages=msgs)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= 256  # vLLM's hit
    after = metric(router_metrics, decisions, worker=f"{holder:x}")
    assert after - before == 2
    for rep in run.replicas("Worker"):
        assert "splitserve_worker_kv_blocks_total" in scrape(rep["metrics"])
