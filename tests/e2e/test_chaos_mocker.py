"""No client sees a worker leave: streams in flight on a mocker fleet survive faults.

Scale-down: one of three workers is removed mid-stream with a drain shorter than the
streams. The replica deregisters (no new requests), its mocker gets the drain to finish,
then is killed; the frontend resumes every stream it cut on another worker after the
tokens already sent.  Chaos: a worker SIGKILLed, a scale-down, a scale-up and NATS
SIGKILLed (the supervisor restarts it), one after the other under the same streams.
Every client gets all its tokens (usage counts each token the frontend passed on, so a
repeated or lost token shows) and a normal finish; the longest pause a client saw
between two chunks (the time to resume) is printed.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import metric
from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import descendants, http_post_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep, pytest.mark.timeout(300)]

STREAMS = 9
MAX_TOKENS = 600


def one_stream(url: str, i: int, streaming: threading.Semaphore | None = None
               ) -> tuple[str | None, int, float]:
    """(finish reason, completion tokens, longest pause between chunks in s); releases
    ``streaming`` once its first chunk arrived."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    last, gap, finish, tokens = time.monotonic(), 0.0, None, 0
    stream = c.completions.create(model=MODEL, prompt=f"stream {i}: " + "tell me more " * 20,
                                  max_tokens=MAX_TOKENS, stream=True,
                                  stream_options={"include_usage": True})
    for ch in stream:
        if streaming is not None:
            streaming.release()
            streaming = None
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if ch.usage:
            tokens = ch.usage.completion_tokens
    return finish, tokens, gap


def migrated_mid_stream(url: str) -> float:
    return metric(f"{url}/metrics", "splitserve_frontend_migrations_total",
                  reason="worker-failed-mid-stream")


def resumed_mid_stream(url: str) -> float:
    """Streams resumed on another worker after their tokens so far: cut when the drained
    worker's mocker was killed, or handed back by the worker at its drain deadline
    (which of the two happens first depends on the machine's load)."""
    return migrated_mid_stream(url) + metric(
        f"{url}/metrics", "splitserve_frontend_migrations_total", reason="worker-drained")


def all_streaming(streaming: threading.Semaphore, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(n):
        assert streaming.acquire(timeout=max(0.0, deadline - time.monotonic())), \
            "not every stream got its first token"


def scale(run, n: int) -> None:
    code, body = http_post_json(run.control() + "/v1/components/Worker/replicas",
                                {"replicas": n}, token=run.token())
    assert code == 200, body


def test_scale_down_mid_stream_loses_no_stream(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=3",
                           "--Worker.drain_timeout_s=2", "--Router.policy=round_robin")
    try:
        streaming = threading.Semaphore(0)
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            futs = [pool.submit(one_stream, url, i, streaming) for i in range(STREAMS)]
            all_streaming(streaming, STREAMS)  # every stream is running
            scale(run, 2)
            results = [f.result(timeout=240) for f in futs]
        assert [r[:2] for r in results] == [("length", MAX_TOKENS)] * STREAMS, results
        wait_until(lambda: len(run.replicas("Worker")) == 2, 60, what="scaled down to 2")
        # round robin put three streams on the removed worker; its 2 s drain cut them
        assert resumed_mid_stream(url) >= 1
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()


def test_chaos_under_streaming_load_loses_no_stream(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=3",
                           "--Worker.drain_timeout_s=2", "--Router.policy=round_robin",
                           "--Common.restart.backoff_initial_s=0.1",
                           "--Common.infra.restart_delay_s=0.5")
    try:
        infra = json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())
        run.seen_pids |= set(infra["pids"].values())
        with cf.ThreadPoolExecutor(STREAMS) as pool:
            futs = [pool.submit(one_stream, url, i) for i in range(STREAMS)]
            time.sleep(1.5)
            victim = next(r for r in run.replicas("Worker") if r["state"] == "ready")
            for pid in [*descendants(victim["pid"]), victim["pid"]]:  # the mocker first
                run.seen_pids.add(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(1.5)
            scale(run, 2)
            time.sleep(1.5)
            scale(run, 3)
            time.sleep(1.0)
            os.kill(infra["pids"]["nats"], signal.SIGKILL)
            results = [f.result(timeout=240) for f in futs]
        assert [r[:2] for r in results] == [("length", MAX_TOKENS)] * STREAMS, results
        print(f"\nlongest pause a client saw (time to resume): "
              f"{max(r[2] for r in results):.2f} s; streams resumed mid-stream: "
              f"{migrated_mid_stream(url):.0f}")
        assert migrated_mid_stream(url) >= 1
        wait_until(lambda: sum(r["state"] == "ready" for r in run.replicas("Worker")) == 3,
                   120, interval_s=0.5, what="three workers ready again")
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.kill_all()
