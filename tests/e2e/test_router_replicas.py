"""Two router replicas behind one frontend: each release reaches the replica that placed
the request, so every replica's in-flight accounting returns to zero, and each replica
follows the other's placements (router.share)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_each_router_replica_gets_the_releases_of_what_it_placed(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Router.replicas=2",
                           "--Worker.replicas=2", "--Worker.engine_args.speedup_ratio=100")
    try:
        for i in range(12):
            r = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": "SmolLM2-135M-Instruct", "prompt": [1000 + i, 2000, 3000],
                "max_tokens": 2})
            assert r.status_code == 200, r.text
        time.sleep(1.0)  # releases are sent in the background
        urls = [rep["metrics"] for rep in run.replicas("Router")]
        counts = [(metric(m, "splitserve_router_decisions_total"),
                   metric(m, "splitserve_router_released_total")) for m in urls]
        followed = [{kind: metric(m, "splitserve_router_shared_events_total",
                                  direction="applied", kind=kind)
                     for kind in ("place", "release")} for m in urls]
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    assert len(counts) == 2
    assert all(placed > 0 for placed, _ in counts), counts  # both replicas routed
    assert all(placed == released for placed, released in counts), counts
    # Each replica followed every request the other placed, to its release.
    assert followed[0] == {"place": counts[1][0], "release": counts[1][0]}, followed
    assert followed[1] == {"place": counts[0][0], "release": counts[0][0]}, followed


def test_each_router_replica_learns_first_tokens_and_progress_as_answers_stream(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend",
                           "configs/mocker_agg_router.yaml", "--Router.replicas=2",
                           "--Worker.replicas=2")
    try:
        for i in range(6):
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "model": "SmolLM2-135M-Instruct", "prompt": [1000 + i, 2000, 3000],
                    "max_tokens": 200, "stream": True}) as r:
                assert r.status_code == 200
                assert sum(1 for line in r.iter_lines() if line.startswith("data: {")) > 0
        time.sleep(1.0)  # reports and releases are sent in the background
        routers = [(metric(m, "splitserve_router_decisions_total"),
                    {k: metric(m, "splitserve_router_progress_reports_total", kind=k)
                     for k in ("first_token", "progress", "late", "stale")})
                   for m in (rep["metrics"] for rep in run.replicas("Router"))]
        sent = metric(f"{url}/metrics",
                      "splitserve_frontend_progress_reports_total", outcome="sent")
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    assert len(routers) == 2 and all(placed > 0 for placed, _ in routers), routers
    # Every answer's first token and its progress every 16 tokens went to the replica
    # that placed it (a report that came after the release is counted as late).
    for placed, kinds in routers:
        assert kinds["first_token"] + kinds["late"] + kinds["progress"] >= placed * 13, routers
        assert kinds["stale"] == 0, routers
    assert sum(k["first_token"] for _, k in routers) > 0, routers
    assert sent == sum(sum(k.values()) for _, k in routers)
