"""Two torch workers behind the KV-aware router: repeated long prompts follow their prefix."""

from __future__ import annotations

import time

import openai
import pytest

from tests.graphs import route_explain, start_graph
from tests.e2e.helpers import metric, scrape

pytestmark = [pytest.mark.e2e, pytest.mark.deep]

MODEL = "SmolLM2-135M-Instruct"
LONG = ("You are reviewing a long design document about a distributed cache. " * 12
        + "Summarise it in one sentence.")


def test_kv_aware_routing_follows_the_prefix(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend", "configs/agg_router.yaml")
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": LONG}]
        first = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                          messages=msgs)
        time.sleep(1.0)  # KV events reach the router asynchronously
        d = route_explain(run, LONG, timeout_s=120)
        holder = d["worker_id"]
        overlap = {int(k): v for k, v in d["decision"]["scorers"][0]["raw"].items()}
        assert overlap[holder] > 0.9 and min(overlap.values()) == 0.0, d
        router_metrics = next(r["metrics"] for r in run.replicas("Router"))
        decisions = "splitserve_router_decisions_total"
        before = metric(router_metrics, decisions, worker=f"{holder:x}")
        for _ in range(3):
            again = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                              messages=msgs)
            assert again.choices[0].message.content == first.choices[0].message.content
            assert again.usage.prompt_tokens_details.cached_tokens > 0  # a real prefix hit
        after = metric(router_metrics, decisions, worker=f"{holder:x}")
        assert after - before == 3
        # the workers export their KV usage and queue length
        for rep in run.replicas("Worker"):
            samples = scrape(rep["metrics"])
            assert "splitserve_worker_kv_usage_ratio" in samples
            assert "splitserve_worker_waiting_requests" in samples
    finally:
        assert run.stop() == 0, run.output()[-3000:]
