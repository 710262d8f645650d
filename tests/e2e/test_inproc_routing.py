"""graphs.agg with `Frontend.routing: in_process`: the routing service runs inside the
frontend (no Router process), fed by the mocker workers' KV events and load reports."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import openai
import pytest

from tests.graphs import route_explain, start_graph
from tests.e2e.helpers import by_label, dynamo, metric, scrape
from tests.e2e.prompts import MODEL
from tests.integration.serve_helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.deep]

LONG = "Summarise the history of the printing press in Europe. " * 30

# One request per worker at a time and one waiting: a burst beyond that is refused at
# once by the admission queue (queue-full), with 503 and Retry-After.
QUEUE = ("--Frontend.router.qos.queue.max_inflight_per_worker=1",
         "--Frontend.router.qos.queue.max_queued=1")


@pytest.fixture(scope="module")
def inproc_graph(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inproc-graph")
    run, url = start_graph(tmp, "graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml",
                           "--Frontend.replicas=1",  # one process's counters on /metrics
                           "--Worker.replicas=2", "--Worker.engine_args.speedup_ratio=50",
                           *QUEUE)
    yield run, url
    run.stop()


def decisions(url: str) -> dict[str, float]:
    """Routing decisions by worker (hex id), from the frontend's own /metrics."""
    return by_label(f"{url}/metrics", "splitserve_router_decisions_total", "worker")


def test_served_without_a_router_process(inproc_graph):
    run, url = inproc_graph
    assert run.replicas("Router") == []
    before = sum(decisions(url).values())
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        r = client.chat.completions.create(model=MODEL, max_tokens=8,
                                           messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert sum(decisions(url).values()) == before + 1
    assert metric(f"{url}/metrics", "splitserve_router_released_total", outcome="ok") >= 1


def test_repeated_prefix_lands_on_the_worker_holding_it(inproc_graph):
    _, url = inproc_graph
    msgs = [{"role": "user", "content": LONG}]
    before = decisions(url)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs)
        first = decisions(url)
        holder = next(w for w, n in first.items() if n > before.get(w, 0))
        time.sleep(0.5)  # KV events reach the frontend's index asynchronously
        for _ in range(3):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=msgs)
    after = decisions(url)
    assert after[holder] - first[holder] == 3, (first, after)
    assert sum(after.values()) - sum(first.values()) == 3
    cached = metric(f"{url}/metrics", "splitserve_router_overlap_blocks_total")
    assert cached > 0  # the prompt's blocks were known to be cached there


def test_route_explain_reads_the_frontends_routing(inproc_graph):
    """With no Router process, `dynamo route explain` asks the frontend's own routing
    (its explain endpoint) and nothing it asks is recorded as a placement."""
    run, url = inproc_graph
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": LONG}])
    time.sleep(0.5)  # KV events reach the frontend's index asynchronously
    before = decisions(url)
    decision = route_explain(run, LONG)
    overlap = {int(k): v for k, v in decision["decision"]["scorers"][0]["raw"].items()}
    assert overlap[decision["worker_id"]] > 0.8, decision  # the holder of the prefix
    assert decisions(url) == before


async def burst(url: str, n: int) -> list[tuple[int, str | None]]:
    body = {"model": MODEL, "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one() -> tuple[int, str | None]:
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")
        return await asyncio.gather(*(one() for _ in range(n)))


def test_admission_queue_refuses_a_burst_with_503(inproc_graph):
    _, url = inproc_graph
    results = asyncio.run(burst(url, 6))
    refused = [ra for status, ra in results if status == 503]
    # two placed (one per worker), one waiting, the other three refused at once
    assert len(refused) >= 3, results
    assert all(ra is not None and int(ra) >= 1 for ra in refused), results
    assert sum(1 for status, _ in results if status == 200) >= 2, results
    verdicts = scrape(f"{url}/metrics").get("splitserve_qos_admissions_total", {})
    assert any(("reason", "queue-full") in k and v >= 3 for k, v in verdicts.items()), verdicts


def profiles(url: str) -> dict[str, float]:
    """Routing decisions by scheduling profile, from the frontend's /metrics."""
    return by_label(f"{url}/metrics", "splitserve_router_decisions_total", "profile")


def test_a_policy_version_is_applied_by_the_frontend(inproc_graph, tmp_path):
    run, url = inproc_graph
    policy = tmp_path / "rr.yaml"
    policy.write_text("router: round_robin\n")
    res = dynamo(run, "policy", "apply", str(policy))
    assert res.returncode == 0, res.stderr + res.stdout
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}

    def switched() -> bool:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10)
        return profiles(url).get("round-robin", 0.0) > 0
    wait_until(switched, 20, interval_s=0.2, what="in-process routing on round-robin")
    shown = dynamo(run, "policy", "show", "--json")
    assert "frontend-0-" in shown.stdout, shown.stdout


def test_disaggregated_graph_routes_to_decode_workers_in_process(tmp_path):
    run, url = start_graph(tmp_path, "graphs.disagg_inproc:Frontend",
                           "configs/mocker_disagg_inproc.yaml",
                           "--DecodeWorker.engine_args.speedup_ratio=50",
                           "--PrefillWorker.engine_args.speedup_ratio=50")
    try:
        assert run.replicas("Router") == []
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as client:
            for content in ("hi", LONG):  # a short prompt stays local, a long one may not
                r = client.chat.completions.create(
                    model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])
                assert r.usage.completion_tokens == 4
        assert sum(decisions(url).values()) == 2
    finally:
        run.stop()
