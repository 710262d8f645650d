"""The local and dry-run connectors, and the apply order of moves (no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from splitserve.planner import Hold, Move, Scale
from splitserve.planner.connectors import DryRunConnector, LocalConnector, replica_steps
from splitserve.planner.connectors.kubernetes import deployment_name, scale_patch

pytestmark = pytest.mark.unit

ACTIONS = [Move("decode", "prefill", 1, 3, 5, "move", "budget"),
           Scale("decode", -1, 2, "scale-down", "low"),
           Hold("prefill", "steady", "")]


def test_replica_steps_shrink_before_growing():
    assert replica_steps(ACTIONS) == [("decode", 3, "move"), ("prefill", 5, "move"),
                                      ("decode", 2, "scale-down")]


def test_dry_run_records_and_reports():
    conn = DryRunConnector()
    results = asyncio.run(conn.apply(ACTIONS))
    assert conn.applied == [("decode", 3), ("prefill", 5), ("decode", 2)]
    assert all(r.ok for r in results)


def test_local_connector_posts_replicas_to_the_supervisor():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, json.loads(request.content)))
        if "DecodeWorker" in request.url.path and calls[-1][2]["replicas"] == 2:
            return httpx.Response(409, json={"error": "graph is shutting down"})
        return httpx.Response(200, json={"ok": True})

    async def main():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        conn = LocalConnector("http://control.test/", client=client)
        results = await conn.apply(ACTIONS)
        await conn.close()
        await client.aclose()
        return results

    results = asyncio.run(main())
    assert calls == [("POST", "/v1/components/DecodeWorker/replicas", {"replicas": 3}),
                     ("POST", "/v1/components/PrefillWorker/replicas", {"replicas": 5}),
                     ("POST", "/v1/components/DecodeWorker/replicas", {"replicas": 2})]
    assert [r.ok for r in results] == [True, True, False]
    assert "HTTP 409" in results[2].detail


@pytest.mark.parametrize(("component", "prefix", "expected"), [
    ("PrefillWorker", "", "prefill-worker"),
    ("DecodeWorker", "disagg-router", "disagg-router-decode-worker"),
    ("KVRouter", "", "kvrouter"),
    ("prefill_worker", "", "prefill-worker"),
])
def test_deployment_names(component, prefix, expected):
    assert deployment_name(component, prefix) == expected


def test_scale_patch_is_a_json_patch():
    assert scale_patch(0) == [{"op": "add", "path": "/spec/replicas", "value": 0}]
