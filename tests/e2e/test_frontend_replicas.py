"""Two frontend processes on one port (`Frontend.replicas: 2`), routing in process: the
supervisor's one socket on loopback, both replicas answering from it and each following
the other's placements, and a replica killed without a connection refused or lost while
the supervisor brings it back."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.helpers import metric
from tests.graphs import MOCKER_FLEET_INPROC, start_graph
from tests.integration.serve_helpers import http_post_json, wait_until
from tests.security.test_listeners import listeners

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _ask(url: str, i: int) -> int:
    # A connection of its own per request: the kernel hands each to whichever replica
    # accepts first.
    with httpx.Client(timeout=30) as client:
        return client.post(f"{url}/v1/completions", headers={"connection": "close"}, json={
            "model": "SmolLM2-135M-Instruct", "prompt": [1000 + i, 2000, 3000],
            "max_tokens": 2}).status_code


def _served(rep: dict) -> float:
    return metric(rep["metrics"], "splitserve_frontend_requests_total", outcome="ok")


@pytest.mark.timeout(300)
def test_two_frontend_replicas_serve_one_port_and_survive_a_kill(tmp_path):
    run, url = start_graph(tmp_path, *MOCKER_FLEET_INPROC, "--Frontend.replicas=2")
    try:
        reps = run.replicas("Frontend")
        assert len(reps) == 2 and all(r["metrics"] for r in reps), reps
        port = int(url.rsplit(":", 1)[1])
        held = {pid: [s for s in listeners(pid) if s[1] == port]
                for pid in (run.proc.pid, *(r["pid"] for r in reps))}
        # One socket, on loopback, held by the supervisor and both replicas.
        assert all(socks == [("127.0.0.1", port)] for socks in held.values()), held

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: _ask(url, i), range(48)))
        assert codes == [200] * 48
        served = [_served(r) for r in reps]
        assert sum(served) == 48 and all(n > 0 for n in served), served
        # Each replica follows the other's requests (router.share): every one the other
        # placed, and each released again.
        for me, other in ((0, 1), (1, 0)):
            wait_until(lambda me=me, other=other: metric(
                reps[me]["metrics"], "splitserve_router_siblings") == 1 and all(
                metric(reps[me]["metrics"], "splitserve_router_shared_events_total",
                       direction="applied", kind=kind) == served[other]
                for kind in ("place", "release")), 10,
                what=f"replica {me} followed replica {other}'s requests")

        victim = reps[0]
        os.kill(victim["pid"], signal.SIGKILL)
        after = [_ask(url, 100 + i) for i in range(20)]  # while it is down and restarting
        assert after == [200] * 20

        def back() -> bool:
            now = run.replicas("Frontend")
            return (len(now) == 2 and all(r["state"] == "ready" for r in now)
                    and victim["pid"] not in {r["pid"] for r in now})
        wait_until(back, 120, what="the killed frontend replica restarted and ready")
        time.sleep(0.2)
        reps = run.replicas("Frontend")
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: _ask(url, 200 + i), range(48)))
        assert codes == [200] * 48
        assert all(_served(r) > 0 for r in reps)  # the new one accepts too

        # Scaled down to one and back to two on the same socket, answering throughout.
        for n in (1, 2):
            code, body = http_post_json(run.control() + "/v1/components/Frontend/replicas",
                                        {"replicas": n}, token=run.token())
            assert code == 200, body
            wait_until(lambda n=n: [r["state"] for r in run.replicas("Frontend")]
                       == ["ready"] * n, 120, what=f"{n} frontend replicas ready")
            assert [_ask(url, 300 + 10 * n + i) for i in range(10)] == [200] * 10
    finally:
        assert run.stop() == 0, run.output()[-3000:]
