"""Workers that cannot be taken down, retries on a dead worker, and truthful readiness,
on live graphs (embedded etcd/NATS, loopback only; every process is killed by pid)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from splitserve.contracts.kit.procs import pid_alive
from tests.graphs import start_graph
from tests.e2e.helpers import metric
from tests.integration.serve_helpers import ServeRun, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep]

MODEL = "SmolLM2-135M-Instruct"
BAD_IDS = [49152, 2**63, -1]


def infra_env(run: ServeRun) -> dict[str, str]:
    state = json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())
    return {"ETCD_ENDPOINTS": state["endpoints"]["etcd"],
            "NATS_SERVER": state["endpoints"]["nats"]}


def completion(url: str, prompt="Once upon a time", max_tokens=4, timeout=60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0})


async def direct_requests(env: dict[str, str], path: str, token_lists: list[list[int]]
                          ) -> list[list[dict]]:
    """Send worker requests straight to ``path`` with Dynamo's client (no frontend)."""
    from dynamo.runtime import DistributedRuntime

    from splitserve.contracts.wire import worker_request

    os.environ.update(env)
    rt = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    try:
        client = await rt.endpoint(path).client()
        await asyncio.wait_for(client.wait_for_instances(), 20)
        out = []
        for i, ids in enumerate(token_lists):
            req = worker_request(model=MODEL, token_ids=ids, max_tokens=4, temperature=0,
                                 top_p=None, seed=None, eos_token_ids=[2],
                                 request_id=f"direct-{i}", priority="default")
            stream = await client.round_robin(req)
            chunks = []
            async for item in stream:
                chunks.append(item.data() if callable(item.data) else item.data)
            out.append(chunks)
        return out
    finally:
        rt.shutdown()


@pytest.fixture
def clean_env(monkeypatch):
    """The in-test Dynamo client reads ETCD_ENDPOINTS/NATS_SERVER from the environment:
    restore the whole environment afterwards, so later tests in this process do not see
    this graph's endpoints (``delenv`` of an unset key would record nothing to undo)."""
    saved = dict(os.environ)
    monkeypatch.setenv("DYN_TCP_RPC_HOST", "127.0.0.1")
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_out_of_vocabulary_ids_sent_to_the_worker_do_not_take_it_down(tmp_path, clean_env):
    run, url = start_graph(tmp_path, "graphs.agg:Frontend", "configs/agg.yaml",
                           "--Worker.engine_args.num_blocks=256")
    try:
        assert completion(url).status_code == 200
        good = [1, 504, 3458, 253]
        answers = asyncio.run(direct_requests(
            infra_env(run), "dynamo.worker.generate",
            [[*good, bad] for bad in BAD_IDS] + [good]))
        assert len(answers) == len(BAD_IDS) + 1  # the bad requests, then a good one
        for bad, chunks in zip(BAD_IDS, answers[:-1], strict=True):
            assert chunks[-1].get("finish_reason") == "error", (bad, chunks)
            assert "vocabulary" in chunks[-1].get("error", ""), (bad, chunks)
        assert answers[-1][-1].get("finish_reason") == "length", answers[-1]
        r = completion(url)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        worker = run.replicas("Worker")[0]
        assert worker["state"] == "ready" and worker["restarts"] == 0
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    finally:
        assert run.stop() == 0, run.output()[-3000:]


def engine_children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the mocker engine under a Worker replica)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def stopped(pid: int) -> bool:
    """The process is stopped by a signal (state T in /proc/PID/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_requests_on_a_killed_worker_are_retried_elsewhere(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Worker.replicas=2",
                           "--Worker.engine_args.speedup_ratio=20",
                           "--Router.policy=round_robin")
    try:
        front = f"{url}/metrics"
        router = next(r["metrics"] for r in run.replicas("Router"))
        victim = run.replicas("Worker")[0]
        engines = engine_children(victim["pid"])
        assert engines, "the mocker engine process of the first replica"
        run.seen_pids |= set(engines)
        # The instance the victim's engine registered, as the router's metrics name it.
        status = json.loads((Path(run.info()["run_dir"]) / "status"
                             / f"Worker-{victim['replica']}.json").read_text())
        victim_label = f"{status['instance_id']:x}"

        def placed_on_victim() -> float:
            return metric(router, "splitserve_router_decisions_total", worker=victim_label)

        results: list[int] = []
        stop_at = time.monotonic() + 6.0
        probe_may_send = threading.Event()  # clear: client 0 waits before its next request
        probe_may_send.set()
        probe_waits = threading.Event()
        killed = threading.Event()

        def client_loop(i: int) -> None:
            with httpx.Client(timeout=60) as c:
                # Client 0 goes on until the kill: it is the one that reaches the frozen
                # engine if the others were caught there mid-stream.
                while time.monotonic() < stop_at or (i == 0 and not killed.is_set()):
                    if i == 0 and not probe_may_send.is_set():
                        probe_waits.set()
                        probe_may_send.wait()
                    r = c.post(f"{url}/v1/completions",
                               json={"model": MODEL, "prompt": f"request {i}",
                                     "max_tokens": 8})
                    results.append(r.status_code)

        with cf.ThreadPoolExecutor(3) as pool:
            futs = [pool.submit(client_loop, i) for i in range(3)]
            try:
                time.sleep(1.5)
                # Whether a request is on the engine, and how far it got, when the engine
                # dies is a matter of timing; so freeze the engine first (SIGSTOP): the
                # requests on it stop where they are, and one placed on it from then on
                # reaches it but gets no token.  Client 0 has nothing in flight while the
                # engine stops, then sends until the router places one of its requests
                # there, and only then the engine is killed: the kill finds, for certain,
                # a request that has not streamed yet, besides any caught mid-stream.
                probe_may_send.clear()
                assert probe_waits.wait(30), "client 0 did not finish its request"
                for pid in engines:
                    os.kill(pid, signal.SIGSTOP)
                wait_until(lambda: all(stopped(pid) for pid in engines), 5, 0.01,
                           "the engine stopped")
                before = placed_on_victim()
                probe_may_send.set()
                wait_until(lambda: placed_on_victim() > before, 30, 0.02,
                           "a request placed on the stopped engine")
            finally:
                for pid in engines:
                    os.kill(pid, signal.SIGKILL)  # the engine dies; its lease outlives it
                killed.set()
                probe_may_send.set()
            for f in futs:
                f.result()
        # Every request is served: one that had not streamed yet is resent, one that had
        # is resumed on the other worker after the tokens it already had.
        failed = [code for code in results if code != 200]
        assert results and failed == [], sorted(set(results))
        failed = metric(front, "splitserve_frontend_worker_failures_total",
                        stage="after_output")
        # (a stream frozen past the stall limit moves as stalled before the kill)
        resumed = sum(metric(front, "splitserve_frontend_migrations_total", reason=reason)
                      for reason in ("worker-failed-mid-stream", "worker-stalled"))
        assert failed == resumed <= 3
        assert metric(front, "splitserve_frontend_request_retries_total") >= 1
        # Dropped at the first failure: far fewer retries than requests sent meanwhile
        # (the dead instance stays in discovery until its lease expires).
        assert metric(front, "splitserve_frontend_request_retries_total") <= 3
        assert metric(router, "splitserve_router_workers_marked_down_total") == 1
    finally:
        run.stop()
    assert not [p for p in run.seen_pids if pid_alive(p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_disagg_frontend_is_ready_only_when_a_request_would_be_served(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run = ServeRun(tmp_path, "graphs.disagg:Frontend", "-f", "configs/mocker_disagg.yaml",
                   f"--Frontend.port={port}", "--DecodeWorker.replicas=1",
                   "--PrefillWorker.replicas=1")
    try:
        def ready() -> bool:
            try:
                return httpx.get(f"{url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
            finally:
                assert run.proc.poll() is None, run.output()[-3000:]

        wait_until(ready, 180, interval_s=0.05, what="frontend /ready")
        statuses = [completion(url, max_tokens=2).status_code for _ in range(3)]
        assert statuses == [200, 200, 200], (statuses, run.output()[-3000:])
        run.wait_ready(60)
    finally:
        run.stop()
