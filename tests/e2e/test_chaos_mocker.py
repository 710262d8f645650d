"""Scale-down under streaming load: no client sees the removed worker leave.

Three mocker workers serve long streams; one is removed mid-stream with a drain shorter
than the streams. The replica deregisters (no new requests), its mocker gets the drain to
finish, then is killed; the frontend resumes every stream it cut on another worker after
the tokens already sent. Every client gets all its tokens and a normal finish.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import start_graph
from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import http_post_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STREAMS = 9
MAX_TOKENS = 600


def one_stream(url: str, i: int) -> tuple[str | None, int, float]:
    """(finish reason, completion tokens, seconds) of one streamed completion."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    t0, finish, tokens = time.monotonic(), None, 0
    stream = c.completions.create(model=MODEL, prompt=f"stream {i}: " + "tell me more " * 20,
                                  max_tokens=MAX_TOKENS, stream=True,
                                  stream_options={"include_usage": True})
    for ch in stream:
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if ch.usage:
            tokens = ch.usage.completion_tokens
    return finish, tokens, time.monotonic() - t0


def test_scale_down_mid_stream_loses_no_stream(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=3",
                           "--Worker.drain_timeout_s=2", "--Router.policy=round_robin")
    try:
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            futs = [pool.submit(one_stream, url, i) for i in range(STREAMS)]
            time.sleep(1.5)  # every stream is running
            code, body = http_post_json(run.control() + "/v1/components/Worker/replicas",
                                        {"replicas": 2}, token=run.token())
            assert code == 200, body
            results = [f.result(timeout=240) for f in futs]
        assert [r[:2] for r in results] == [("length", MAX_TOKENS)] * STREAMS, results
        wait_until(lambda: len(run.replicas("Worker")) == 2, 60, what="scaled down to 2")
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        moved = [ln for ln in metrics.splitlines()
                 if ln.startswith('splitserve_frontend_migrations_total{reason="worker-'
                                  'failed-mid-stream"}')]
        # round robin put three streams on the removed worker; its 2 s drain cut them
        assert moved and float(moved[0].rpartition(" ")[2]) >= 1, moved
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()
