"""A worker killed mid-stream: the client's stream goes on, resumed on the other worker.

Two torch workers behind the KV-aware router. A greedy stream is interrupted by
SIGKILLing the worker that serves it after a few chunks; the frontend resumes the request
on the other worker with the prompt plus the tokens already streamed, and the text the
client reads equals an uninterrupted run, with no token missing or repeated.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import metric, scrape
from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "Write a short story about a lighthouse keeper and a storm."
MAX_TOKENS = 64


def stream_text(c: openai.OpenAI, on_chunk=None) -> str:
    parts: list[str] = []
    stream = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                                       stream=True,
                                       messages=[{"role": "user", "content": PROMPT}])
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
            if on_chunk:
                on_chunk(len(parts))
    return "".join(parts)


def test_killed_worker_mid_stream_is_resumed_with_identical_text(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend", "configs/agg_router.yaml",
                           "--Common.restart.backoff_initial_s=0.1")
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        expected = stream_text(c)
        assert len(expected) > 40
        killed: list[int] = []

        def kill_the_serving_worker(chunks: int) -> None:
            if chunks != 8 or killed:
                return
            for rep in run.replicas("Worker"):
                if rep["state"] == "ready" and rep["metrics"] and metric(
                        rep["metrics"], "splitserve_worker_running_requests") >= 1:
                    os.kill(rep["pid"], signal.SIGKILL)
                    killed.append(rep["pid"])
                    return

        got = stream_text(c, kill_the_serving_worker)
        assert killed, "no worker was found serving the stream"
        assert got == expected
        moved = scrape(f"{url}/metrics").get("splitserve_frontend_migrations_total", {})
        assert moved == {(("reason", "worker-failed-mid-stream"),): 1.0}, moved
        wait_until(lambda: sum(r["state"] == "ready" for r in run.replicas("Worker")) == 2,
                   120, interval_s=0.5, what="killed worker restarted")
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()
