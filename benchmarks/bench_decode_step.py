"""What a mocker worker's decode step follows: the number of requests in its batch, or
the KV tokens the batch reads.

One aggregated graph with one simulated worker (the geometry of ``heldout.py``'s fleet:
block 64, 7,500 blocks, speedup 1).  For each batch size N and prompt length P, N
requests of P random token ids are sent at once, each asking for 400 output tokens with
``ignore_eos``; a request's step is the mean gap between its last 101 streamed tokens,
measured by the client, when every prompt of the group has long been prefilled (no
prefill stall in it).  Same N, longer prompts: a step that follows the count stays, a
step that follows the KV tokens grows.

    python benchmarks/bench_decode_step.py --out benchmarks/results/decode_step.json

Binds 127.0.0.1 only; the graph is stopped (by process group and pid) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from splitserve.bench.graphrun import GraphRun

REPO = Path(__file__).resolve().parents[1]
FLEET = ["--Worker.replicas=1", "--Worker.engine_args.block_size=64",
         "--Worker.engine_args.num_gpu_blocks=7500", "--Worker.engine_args.speedup_ratio=1",
         "--Frontend.router.block_size=64"]
MODEL = "SmolLM2-135M-Instruct"
LAST_GAPS = 100


async def one(client: aiohttp.ClientSession, url: str, prompt: list[int],
              output: int) -> float | None:
    """The mean gap (s) between the last ``LAST_GAPS`` + 1 tokens of one answer."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    times: list[float] = []
    async with client.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    if len(times) <= LAST_GAPS:
        return None
    return (times[-1] - times[-1 - LAST_GAPS]) / LAST_GAPS


async def group(url: str, n: int, prompt_len: int, output: int) -> dict:
    rnd = random.Random(n * 100_003 + prompt_len)  # unique prompts: no prefix shared
    prompts = [[rnd.randrange(100, 40_000) for _ in range(prompt_len)] for _ in range(n)]
    async with aiohttp.ClientSession() as client:
        steps = await asyncio.gather(*(one(client, url, p, output) for p in prompts))
    got = sorted(s * 1000.0 for s in steps if s is not None)
    return {"requests": n, "prompt_tokens": prompt_len, "answers": len(got),
            "kv_tokens_at_end": n * (prompt_len + output),
            "step_ms_p50": round(statistics.median(got), 2) if got else None,
            "step_ms_min": round(got[0], 2) if got else None,
            "step_ms_max": round(got[-1], 2) if got else None}


async def sweep(url: str, sizes: list[int], prompts: list[int], output: int) -> list[dict]:
    rows = []
    for n in sizes:
        for p in prompts:
            await asyncio.sleep(1.0)
            row = await group(url, n, p, output)
            print(f"{n:3d} requests, {p:5d}-token prompts: step p50 {row['step_ms_p50']} ms "
                  f"({row['answers']} answers)", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 48])
    ap.add_argument("--prompts", type=int, nargs="+", default=[256, 6000])
    ap.add_argument("--output", type=int, default=400)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/decode_step.json"))
    args = ap.parse_args(argv)
    if args.output <= LAST_GAPS:
        ap.error(f"--output must be more than {LAST_GAPS}")
    # One frontend process (the config runs two), as in the runs recorded before.
    with GraphRun("graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml",
                  [*FLEET, "--Frontend.replicas=1"]) as g:
        rows = asyncio.run(sweep(g.url, args.sizes, args.prompts, args.output))
    Path(args.out).write_text(json.dumps({
        "command": " ".join(["python benchmarks/bench_decode_step.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "what": "a mocker worker's decode step (mean gap of each answer's last 100 tokens, "
                "client-side) by batch size and prompt length", "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
