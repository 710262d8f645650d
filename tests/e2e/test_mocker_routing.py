"""The agg_router graph with Dynamo's mocker: this project's router in the request path."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.graphs import route_explain, start_graph
from tests.e2e.helpers import metric
from tests.integration.serve_helpers import wait_until

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
LONG = "Summarise the history of the printing press in Europe. " * 30


def test_openai_client_streaming_and_not(mocker_graph):
    _, url = mocker_graph
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    r = client.chat.completions.create(model=MODEL, max_tokens=12,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=6, stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason == "length"
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert c.usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == [MODEL]


def test_repeated_long_prompt_goes_to_the_worker_holding_its_prefix(mocker_graph):
    run, url = mocker_graph
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    msgs = [{"role": "user", "content": LONG}]
    client.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs)
    time.sleep(0.5)  # KV events reach the router asynchronously
    decision = route_explain(run, LONG)
    holder = decision["worker_id"]
    overlap = {int(k): v for k, v in decision["decision"]["scorers"][0]["raw"].items()}
    assert overlap[holder] > 0.8, decision  # the prompt's blocks are cached there
    assert sorted(overlap.values())[0] == 0.0  # ...and not on the other worker
    router_metrics = next(r["metrics"] for r in run.replicas("Router"))
    decisions = "splitserve_router_decisions_total"
    before = metric(router_metrics, decisions, worker=f"{holder:x}")
    for _ in range(3):
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs)
    after = metric(router_metrics, decisions, worker=f"{holder:x}")
    assert after - before == 3


def test_killed_worker_fails_its_stream_quickly(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=1",
                           "--Worker.engine_args.speedup_ratio=1",
                           "--Frontend.inter_token_timeout_s=10")
    try:
        engine_pid = None
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"{url}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2000, "stream": True,
                    "messages": [{"role": "user", "content": "go"}]}) as resp:
                lines = resp.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data:"))
                assert "chat.completion.chunk" in first
                status_file = next((run.state / "runs").glob("*/status/Worker-0.json"))
                status = json.loads(status_file.read_text())
                engine_pid = status["engine_pid"]
                t0 = time.monotonic()
                os.kill(engine_pid, signal.SIGKILL)
                rest = [ln for ln in lines if ln]
                elapsed = time.monotonic() - t0
        assert elapsed < 12, f"stream took {elapsed:.1f}s to fail"
        assert rest[-1] == "data: [DONE]"
        assert any('"error"' in ln for ln in rest), rest[-3:]
        # the supervisor restarts the worker and the graph serves again
        wait_until(lambda: httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]
        }).status_code == 200, 60, interval_s=1, what="serving after restart")
    finally:
        run.stop()
