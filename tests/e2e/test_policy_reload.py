"""Live policy changes under load: `dynamo policy apply` / `rollback` against a running
graph; the router switches policy without dropping or failing in-flight requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.helpers import by_label, dynamo
from tests.graphs import MOCKER_FLEET, start_graph
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep]

MODEL = "SmolLM2-135M-Instruct"


def profiles(run) -> dict[str, float]:
    url = next(r["metrics"] for r in run.replicas("Router"))
    return by_label(url, "splitserve_router_decisions_total", "profile")


@pytest.fixture
def fleet_graph(tmp_path):
    """Its own mocker fleet: applying policies changes the graph for whoever comes next."""
    run, url = start_graph(tmp_path / "graph", *MOCKER_FLEET)
    yield run, url
    assert run.stop() == 0, run.output()[-3000:]


def test_apply_and_rollback_under_load(tmp_path, fleet_graph):
    run, url = fleet_graph
    failures: list[str] = []
    done = 0
    stop = threading.Event()

    def client() -> None:
        nonlocal done
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(f"{url}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 16, "stream": False,
                    "messages": [{"role": "user", "content": "steady load " * 20}]})
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                done += 1

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        first = tmp_path / "cost.yaml"
        first.write_text("router: latency_cost\n")
        res = dynamo(run, "policy", "apply", str(first))
        assert res.returncode == 0, res.stderr + res.stdout
        wait_until(lambda: profiles(run).get("latency-cost", 0.0) > 5, 20, interval_s=0.2,
                   what="router switched to latency-cost")
        policy = tmp_path / "rr.yaml"
        policy.write_text("router: round_robin\n"
                          "qos: {enable_early_rejection: true, low_priority_threshold_ms: 500,"
                          " reject_on_slo_violation: true}\n")
        res = dynamo(run, "policy", "apply", str(policy))
        assert res.returncode == 0, res.stderr + res.stdout
        before = profiles(run).get("round-robin", 0.0)
        wait_until(lambda: profiles(run).get("round-robin", 0.0) > before + 5, 20,
                   interval_s=0.2, what="router switched to round-robin")
        shown = json.loads(dynamo(run, "policy", "show", "--json").stdout)
        assert "Router" in json.dumps(shown)
        res = dynamo(run, "policy", "rollback")
        assert res.returncode == 0, res.stderr + res.stdout
        cost_before = profiles(run).get("latency-cost", 0.0)
        wait_until(lambda: profiles(run).get("latency-cost", 0.0) > cost_before + 5, 20,
                   interval_s=0.2, what="router back on its previous policy")
        bad = tmp_path / "bad.yaml"
        bad.write_text("router: no_such_policy\n")
        res = dynamo(run, "policy", "apply", str(bad))
        assert res.returncode == 2 and "router" in (res.stdout + res.stderr)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == [], failures[:3]
    assert done > 20
