"""Returning conversations served from the torch worker's host and disk KV tiers, through
the whole graph: a tiny pool pushes a conversation's prefix down to the host tier (and,
with more traffic, on to the disk tier); the router's `route explain` sees it there, live;
the conversation's return restores it (the worker's tier counters show the restore) and
its greedy answer equals the answer computed the first time, from nothing.  A Router
that restarts asks the worker to announce its cache and sees every tier as before."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.helpers import kill_replica, metric, ready
from tests.integration.serve_helpers import wait_until
from tests.graphs import route_explain, start_graph

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 8192  # bytes of one 16-token block of the tiny Llama: 2 layers x 2 x 16 x 2 x 16 x 4
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "piano", "amber",
         "delta", "ember", "frost"]


def conversation(word: str) -> list[dict]:
    return [{"role": "user", "content": f"{word} " * 48 + "?"}]


def tier_hits(url: str, tier: str) -> float:
    return metric(url, "splitserve_worker_kv_tier_hits_total", tier=tier)


@pytest.mark.timeout(300)
def test_a_returning_conversation_is_restored_from_host_then_from_disk(tmp_path, tiny_models):
    run, url = start_graph(
        tmp_path, "graphs.agg_router:Frontend", "configs/agg_router.yaml",
        f"--Common.model={tiny_models['llama']}", "--Common.served_model_name=tiny",
        "--Worker.replicas=1", "--Worker.engine_args.num_blocks=8",
        f"--Worker.engine_args.host_kv_cache_gib={8 * BLOCK / 2**30}",
        f"--Worker.engine_args.disk_kv_cache_dir={tmp_path / 'kv'}",
        f"--Worker.engine_args.disk_kv_cache_gib={96 * BLOCK / 2**30}",
        "--Common.restart.backoff_initial_s=0.1", timeout_s=240)
    try:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        worker_metrics = next(r["metrics"] for r in run.replicas("Worker"))

        def ask(word: str):
            return c.chat.completions.create(model="tiny", temperature=0, max_tokens=6,
                                             messages=conversation(word))

        def hits_seen_by_router(word: str) -> dict[str, int]:
            d = route_explain(run, conversation(word)[0]["content"])
            return next(iter(d["decision"]["tier_hits"].values()),
                        {"device": 0, "host": 0, "disk": 0})

        # -- host: the first answer is computed from nothing (no tier holds anything yet)
        first = ask(WORDS[0])
        assert tier_hits(worker_metrics, "host") == 0
        for word in WORDS[1:3]:  # the pool (8 blocks) evicts the conversation to host
            ask(word)
        time.sleep(1.0)  # tier events reach the router asynchronously
        seen = hits_seen_by_router(WORDS[0])
        assert seen["host"] > 0 and seen["disk"] == 0, seen
        again = ask(WORDS[0])
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= 16 * seen["host"]
        host_hits = tier_hits(worker_metrics, "host")
        assert host_hits >= seen["host"]
        restored = metric(worker_metrics, "splitserve_worker_kv_tier_moved_blocks_total",
                          direction="restored")
        assert restored >= host_hits
        # -- disk: more conversations push this one through the host tier onto disk
        first = ask(WORDS[3])
        for word in WORDS[4:]:
            ask(word)
        time.sleep(1.0)
        seen = hits_seen_by_router(WORDS[3])
        assert seen["disk"] > 0, seen
        assert tier_hits(worker_metrics, "disk") == 0
        again = ask(WORDS[3])
        assert again.choices[0].message.content == first.choices[0].message.content
        assert tier_hits(worker_metrics, "disk") >= seen["disk"]
        assert metric(worker_metrics, "splitserve_worker_kv_tier_moved_blocks_total",
                      direction="restored") >= restored + seen["disk"]
        assert metric(worker_metrics, "splitserve_worker_kv_tier_read_seconds_count",
                      tier="disk") >= seen["disk"]
        assert metric(worker_metrics, "splitserve_worker_kv_tier_event_messages_total",
                      outcome="failed") == 0
        # -- a Router that starts after the worker: the worker announces its cache again,
        # so the new Router indexes what the old one did, tier by tier.
        def indexed(rep: dict) -> dict[str, float]:
            return {t: metric(rep["metrics"], "splitserve_router_kv_indexed_blocks", tier=t)
                    for t in ("device", "host", "disk")}
        old = next(iter(ready(run, "Router")))
        before = indexed(old)
        assert before["host"] > 0 and before["disk"] > 0, before
        probe = hits_seen_by_router(WORDS[1])
        assert probe["host"] + probe["disk"] > 0, probe
        kill_replica(run, old)
        wait_until(lambda: [r for r in ready(run, "Router") if r["pid"] != old["pid"]], 120,
                   interval_s=0.2, what="a new Router ready")
        new = next(r for r in ready(run, "Router") if r["pid"] != old["pid"])
        wait_until(lambda: indexed(new) == before, 30, interval_s=0.2,
                   what=f"the new Router's index {before}")
        assert hits_seen_by_router(WORDS[1]) == probe  # and so are its decisions
    finally:
        assert run.stop() == 0, run.output()[-3000:]
