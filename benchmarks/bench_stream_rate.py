"""How fast a frontend delivers many long answers at once: the step each streamed answer
sees, through this project's frontend and through Dynamo's, on the same mocker fleet.

The fleet of ``heldout.py`` (simulated SGLang workers, block 64, 7,500 blocks, speedup 1).
For each point, ``streams`` answers per worker are started at once, each on a prompt of
``--prompt`` random token ids (no prefix shared) asking for ``--output`` tokens with
``ignore_eos``; after every prompt has been prefilled (3 s), short requests on the same
prompt length may arrive at ``rate`` a second per worker for 8 s (prompts to prefill
beside the answers).  A point's step is each answer's mean gap between tokens in a 6 s
window of that time, measured by the client, p50 over the answers.  The mocker computes a
step from the KV its batch reads, so the two frontends should see the same steps unless
one of them cannot stream the tokens as fast as the fleet makes them: on a small machine
a frontend's CPU per token is also taken from the workers beside it.

    python benchmarks/bench_stream_rate.py --out benchmarks/results/stream_rate.json
    python benchmarks/bench_stream_rate.py --points 40:0 40:2 --configs splitserve dynamo-kv

This project's frontend runs its admission in shadow mode (nothing refused, so both
frontends carry the same load), routing in process (``splitserve``) or in a Router
process (``splitserve-router``; with ``--ours-set=--Frontend.replicas=2`` two frontend
processes share the port).  Binds 127.0.0.1 only; every process started is stopped
(by process group and pid).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import itertools
import json
import random
import statistics
import sys
import time
import types
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
SETTLE_S = 3.0  # every prompt prefilled before the window
ARRIVALS_S = 8.0
WINDOW = (1.0, 7.0)  # seconds after the settling, where the steps are read


def _heldout():
    """benchmarks/heldout.py, for its fleet and its ``deployment``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("heldout")


async def one(client: aiohttp.ClientSession, url: str, prompt: list[int], output: int,
              out: list) -> None:
    """One streamed completion; appends (sent at, [each chunk's arrival])."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    sent, times = time.perf_counter(), []
    async with client.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    out.append((sent, times))


def steps_in(answers: list, start: float) -> list[float]:
    """Each answer's mean gap (ms) between tokens that both arrived in the window."""
    w0, w1 = start + SETTLE_S + WINDOW[0], start + SETTLE_S + WINDOW[1]
    out = []
    for _, times in answers:
        gaps = [b - a for a, b in itertools.pairwise(times) if a >= w0 and b <= w1]
        if gaps:
            out.append(1000.0 * sum(gaps) / len(gaps))
    return out


async def point(url: str, workers: int, streams: int, rate: float, prompt: int,
                output: int, seed: int) -> dict:
    rnd = random.Random(seed)

    def ids() -> list[int]:
        return [rnd.randrange(100, 40_000) for _ in range(prompt)]

    answers: list = []
    shorts: list = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as client:
        start = time.perf_counter()
        longs = [asyncio.create_task(one(client, url, ids(), output, answers))
                 for _ in range(streams * workers)]
        await asyncio.sleep(SETTLE_S)
        extra = []
        end = time.perf_counter() + ARRIVALS_S
        while rate > 0 and time.perf_counter() < end:
            extra.append(asyncio.create_task(one(client, url, ids(), 2, shorts)))
            await asyncio.sleep(rnd.expovariate(rate * workers))
        await asyncio.gather(*longs, *extra)
    steps = sorted(steps_in(answers, start))
    ttfts = sorted(1000.0 * (t[0] - s) for s, t in shorts if t)
    return {"workers": workers, "streams_per_worker": streams, "rate_per_worker": rate,
            "prompt_tokens": prompt, "output_tokens": output, "answers": len(steps),
            "step_ms_p50": round(statistics.median(steps), 2) if steps else None,
            "step_ms_p90": round(steps[int(0.9 * (len(steps) - 1))], 2) if steps else None,
            "short_ttft_ms_p50": round(statistics.median(ttfts), 1) if ttfts else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["splitserve", "dynamo-kv"],
                    choices=["splitserve", "splitserve-router", "dynamo-kv"],
                    help="splitserve: routing in the frontend (graphs.agg); "
                    "splitserve-router: in a Router process (graphs.agg_router), e.g. with "
                    "--ours-set=--Frontend.replicas=2")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--points", nargs="+", default=["10:0", "20:0", "30:0", "40:0", "40:2"],
                    metavar="STREAMS:RATE", help="answers per worker : short requests a "
                    "second per worker")
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--output", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1, help="the configurations alternate")
    ap.add_argument("--ours-set", nargs="*", action="extend", default=[],
                    metavar="--SECTION.FIELD=VALUE", help="extra overrides for this "
                    "project's frontend (experiments): --ours-set=--SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/stream_rate.json"))
    args = ap.parse_args(argv)
    points = [(int(p.split(":")[0]), float(p.split(":")[1])) for p in args.points]
    heldout = _heldout()
    case = heldout.Case("none", 1, 1.0, args.workers, "ttft=1000,tpot=50", 10.0,
                        ((1.0, 1.0),))
    # This project's configurations: heldout.py's deployment, admission in shadow mode.
    ours = {"splitserve": (heldout.OURS, "--Frontend.router.qos.mode=shadow"),
            "splitserve-router": (heldout.ROUTER, "--Router.qos.mode=shadow")}
    rows = []
    for rnd in range(args.rounds):
        for config in args.configs if rnd % 2 == 0 else args.configs[::-1]:
            name, shadow = ours.get(config, (config, None))
            opts = types.SimpleNamespace(startup_timeout_s=180.0, ours_set=[
                *([shadow] if shadow else []), *args.ours_set])
            with heldout.deployment(name, case, opts) as (url, _, _):
                for i, (streams, rate) in enumerate(points):
                    row = asyncio.run(point(url, args.workers, streams, rate, args.prompt,
                                            args.output, seed=1000 * rnd + i))
                    row.update(config=config, round=rnd)
                    print(json.dumps(row), flush=True)
                    if not row["answers"]:
                        print("no answer was still streaming in the window: raise "
                              "--output", file=sys.stderr, flush=True)
                    rows.append(row)
                    time.sleep(2.0)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(["python benchmarks/bench_stream_rate.py", "--configs",
                             *args.configs, "--workers", str(args.workers), "--points",
                             *args.points, "--prompt", str(args.prompt), "--output",
                             str(args.output), "--rounds", str(args.rounds),
                             *(f"--ours-set={v}" for v in args.ours_set)]),
        "what": "the step (ms between tokens, client-side) of many long answers streamed "
                "at once, per frontend, on the same mocker fleet", "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
