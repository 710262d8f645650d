"""The planner inside a served graph scales real local worker processes under a load step
(low -> ~3x -> low): prefill replicas go up within a few intervals and come back down
afterwards without flapping, and no request fails while replicas are removed."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import aiohttp
import pytest

from tests.graphs import start_graph

pytestmark = [pytest.mark.e2e, pytest.mark.quiet]

MODEL = "SmolLM2-135M-Instruct"
PROMPT_TOKENS = 2000


async def load(url: str, rps: float, seconds: float, results: list, rng: random.Random):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one() -> None:
            prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
            try:
                async with s.post(f"{url}/v1/completions", json={
                        "model": MODEL, "prompt": prompt, "max_tokens": 4}) as r:
                    await r.read()
                    results.append(r.status)
            except Exception as exc:  # noqa: BLE001 - counted as a failure
                results.append(repr(exc))

        tasks = []
        start = time.perf_counter()
        n = int(rps * seconds)
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rps - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)


def prefill_replicas(run) -> int:
    return sum(1 for r in run.replicas("PrefillWorker") if r["state"] in ("ready", "starting",
                                                                           "loading"))


def test_load_step_scales_prefill_up_then_down(tmp_path):
    run, url = start_graph(tmp_path, "graphs.disagg_planner:Frontend",
                           "configs/disagg_planner.yaml")
    timeline: list[tuple[float, int]] = []
    results: list = []
    stop = asyncio.Event()

    async def watch() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            timeline.append((time.monotonic() - t0, await asyncio.to_thread(prefill_replicas,
                                                                             run)))
            await asyncio.sleep(1.0)

    async def scenario() -> None:
        watcher = asyncio.create_task(watch())
        rng = random.Random(7)
        await load(url, 1.0, 8, results, rng)     # low
        await load(url, 12.0, 20, results, rng)   # step up
        await load(url, 1.0, 40, results, rng)    # back to low: scale-down happens here
        stop.set()
        await watcher

    try:
        asyncio.run(scenario())
    finally:
        assert run.stop() == 0, run.output()[-3000:]
    counts = [c for _, c in timeline]
    peak = max(counts)
    assert peak >= 2, f"prefill never scaled up: {timeline}"
    up_at = next(t for t, c in timeline if c >= 2)
    assert up_at < 8 + 20, f"scaled up too late: {timeline}"
    assert counts[-1] < peak, f"prefill never scaled back down: {timeline}"
    # no flapping: once it started going down it never went back up
    first_down = next(i for i in range(1, len(counts)) if counts[i] < counts[i - 1])
    assert all(b <= a for a, b in itertools.pairwise(counts[first_down:])), timeline
    failures = [r for r in results if r != 200]
    assert failures == [], failures[:5]
