"""Overload with QoS: ~3x capacity for a bounded time against a mocker fleet.

High priority keeps its TTFT target, low priority gets fast 503s with Retry-After (not
timeouts), every request gets an answer, and the frontend and router stay bounded in
memory.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from tests.graphs import start_graph
from tests.e2e.helpers import one as shared_one

# Exclusive, not quiet: the load generator, the frontend, the router and two mockers
# together take more than the core a quiet module may use, and the early-rejection bound
# (503 within 0.5 s) failed beside a model module on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]

MODEL = "SmolLM2-135M-Instruct"
CONFIG = str(Path(__file__).resolve().parents[1] / "fixtures" / "qos_overload.yaml")
CAPACITY_RPS = 13  # measured: 2 workers x max_num_seqs 2, 48 output tokens (see docs/qos.md)
OFFERED_RPS = 3 * CAPACITY_RPS
SECONDS = 12
HIGH_EVERY = 4  # one request in four is high priority
WARMUP_IDS = 100_000  # the warm-up's prompts: none of them is cached for the measured load


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one(session, url: str, i: int) -> dict:
    cls = "high" if i % HIGH_EVERY == 0 else "low"
    return {"cls": cls, **await shared_one(session, url, i, headers={"x-priority": cls})}


async def offered_load(url: str) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=40)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = []
        start = time.perf_counter()
        for i in range(OFFERED_RPS * SECONDS):
            await asyncio.sleep(max(0.0, start + i / OFFERED_RPS - time.perf_counter()))
            tasks.append(asyncio.create_task(one(s, url, i)))
        return await asyncio.gather(*tasks)


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_overload_rejects_low_priority_early_and_keeps_high_within_target(tmp_path):
    run, url = start_graph(tmp_path, "graphs.agg_router:Frontend", CONFIG)
    try:
        pids = {r["component"]: r["pid"] for r in run.replicas("Frontend") + run.replicas("Router")}
        asyncio.run(offered_load_warmup(url))
        before = {c: rss_mb(p) for c, p in pids.items()}
        results = asyncio.run(offered_load(url))
        after = {c: rss_mb(p) for c, p in pids.items()}
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    sent = OFFERED_RPS * SECONDS
    assert len(results) == sent
    lost = [r for r in results if r["status"] is None]
    assert lost == [], lost[:3]  # none lost, none hung
    high = [r for r in results if r["cls"] == "high"]
    low = [r for r in results if r["cls"] == "low"]
    assert all(r["status"] == 200 for r in high), \
        [(r.get("code"), r["t"]) for r in high if r["status"] != 200][:3]
    high_ttft = [r["ttft"] for r in high if r["ttft"] is not None]
    assert len(high_ttft) == len(high)
    assert p99(high_ttft) < 1.5, f"high-priority p99 TTFT {p99(high_ttft):.2f}s"
    rejected = [r for r in low if r["status"] == 503]
    assert len(rejected) > len(low) * 0.3, "overload should reject much of the low priority"
    assert all(r["retry_after"] and r["code"] == "rejected-ttft-slo-risk" for r in rejected)
    assert p99([r["t"] for r in rejected]) < 0.5  # rejected early, not after a wait
    assert all(r["status"] in (200, 503) for r in low)
    for comp in before:
        assert after[comp] - before[comp] < 60, (comp, before[comp], after[comp])
    summary = {"sent": sent, "high_p99_ttft_s": p99(high_ttft),
               "low_rejected": len(rejected), "low_total": len(low)}
    print(json.dumps(summary))


async def offered_load_warmup(url: str) -> None:
    """Teach the router's predictor the rates the overload depends on: a few requests of
    each class one at a time (the unloaded TTFT and TPOT), then a burst of high-priority
    ones, always admitted, that queue on both workers, so the TTFT fit has seen requests
    wait behind others and its slope is what a prompt token ahead costs when batches are
    full.  The warm-up's prompts are not the measured load's, so that none of those is
    cached (a cached prompt is predicted to add almost nothing ahead of later requests).

    Taught by unloaded requests alone, the slope was the prefill's cost per token (0.35
    ms), not what a request queued behind two-sequence batches waits per token ahead
    (1.1-2 ms): the first 0.7 s of the overload admitted 18 low-priority requests, each
    predicted within its 400 ms, before the first releases corrected the fit, and the
    high-priority requests of the next second waited 1.2-1.45 s behind that queue, how
    long depending on how fast the machine drained it: the p99 was that cluster, a
    little under the 1.5 s target or over it."""
    async with aiohttp.ClientSession() as s:
        for i in range(8):
            await one(s, url, WARMUP_IDS + i)
        await asyncio.gather(*(one(s, url, WARMUP_IDS + HIGH_EVERY * i) for i in range(16)))
