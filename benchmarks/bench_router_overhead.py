"""Latency the frontend and router add over calling a worker directly.

Brings up ``graphs.agg_router:Frontend`` with mocker workers at a very high speedup (so
the engine itself costs ~nothing), then at each offered rate sends the same requests
two ways, interleaved in one run so both see the same machine load:

- direct: Dynamo client → worker ``generate`` (what a caller without our stack pays);
- through the stack: HTTP → frontend (validation, chat template, tokenisation) →
  router ``route`` RPC → worker ``generate`` → detokenisation → HTTP response.

``--routing in_process`` brings up ``graphs.agg:Frontend`` with
``configs/mocker_agg_inproc.yaml`` instead: the same routing service runs inside the
frontend, so the stack path has no route or release RPC.  ``--routing router in_process``
measures both, one graph after the other (each variant's direct path is its own baseline).

Arrivals are Poisson at the offered rate (open loop); each request asks for 4 tokens.
Prints p50/p90/p99 of both and of the difference, writes JSON.

    python benchmarks/bench_router_overhead.py --rates 25 50 100 150 --seconds 10
    python benchmarks/bench_router_overhead.py --rates 100 --seconds 10 \
        --routing router in_process
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": pct(xs, .5) * 1e3, "p90_ms": pct(xs, .9) * 1e3,
            "p99_ms": pct(xs, .99) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3 if xs else 0}


async def run_rate(rate: float, seconds: float, url: str, client, worker_ids, token_ids,
                   session) -> dict:
    rng = random.Random(int(rate))
    http_lat: list[float] = []
    direct_lat: list[float] = []
    errors = {"http": 0, "direct": 0}
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say something short."}]}
    req = {"model": MODEL, "token_ids": token_ids, "stop_conditions": {"max_tokens": 4},
           "sampling_options": {"temperature": 0.0}, "eos_token_ids": [2]}

    async def one_http():
        t = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            await r.read()
            if r.status != 200:
                errors["http"] += 1
                return
        http_lat.append(time.perf_counter() - t)

    async def one_direct(i: int):
        t = time.perf_counter()
        try:
            stream = await client.direct(req, worker_ids[i % len(worker_ids)])
            async for _ in stream:
                pass
        except Exception:  # noqa: BLE001 - counted
            errors["direct"] += 1
            return
        direct_lat.append(time.perf_counter() - t)

    tasks = []
    start = time.perf_counter()
    i = 0
    next_at = start
    while next_at - start < seconds:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        # alternate the two paths so both see the same offered load pattern
        tasks.append(asyncio.create_task(one_http() if i % 2 == 0 else one_direct(i)))
        i += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    achieved = i / (time.perf_counter() - start)
    h, d = summary(http_lat), summary(direct_lat)
    return {"offered_rps": rate, "achieved_rps": achieved, "http": h, "direct": d,
            "added_p50_ms": h["p50_ms"] - d["p50_ms"], "added_p90_ms": h["p90_ms"] - d["p90_ms"],
            "added_p99_ms": h["p99_ms"] - d["p99_ms"], "errors": errors}


async def measure(args, url: str, etcd: str, nats: str) -> list[dict]:
    import aiohttp

    os.environ["ETCD_ENDPOINTS"], os.environ["NATS_SERVER"] = etcd, nats
    os.environ.setdefault("DYN_TCP_RPC_HOST", "127.0.0.1")
    from splitserve.contracts.kit.component import make_runtime

    rt = make_runtime(asyncio.get_running_loop(), "tcp")
    client = await rt.endpoint("dynamo.worker.generate").client()
    worker_ids = await client.wait_for_instances()
    from splitserve.contracts.kit.cache import model_cache_dir
    from splitserve.contracts.kit.model_dir import export_model_dir
    from splitserve.components.frontend.textcodec import TextCodec

    codec = TextCodec.from_dir(export_model_dir(model_cache_dir(MODEL)))
    token_ids = codec.chat_ids([{"role": "user", "content": "Say something short."}])
    out = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await run_rate(20, 2, url, client, worker_ids, token_ids, session)  # warm-up
        for rate in args.rates:
            res = await run_rate(rate, args.seconds, url, client, worker_ids, token_ids, session)
            out.append(res)
            print(f"[{args.variant}] offered {rate:6.1f} req/s (achieved {res['achieved_rps']:.1f}): "
                  f"stack p50 {res['http']['p50_ms']:.2f} p99 {res['http']['p99_ms']:.2f} ms | "
                  f"direct p50 {res['direct']['p50_ms']:.2f} p99 {res['direct']['p99_ms']:.2f} ms"
                  f" | added p50 {res['added_p50_ms']:.2f} p99 {res['added_p99_ms']:.2f} ms "
                  f"| errors {res['errors']}", flush=True)
    rt.shutdown()
    return out


GRAPHS = {
    "router": ("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml"),
    "in_process": ("graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml"),
}


def run_variant(args, routing: str) -> list[dict]:
    """Bring up the graph of ``routing``, measure every rate, stop it; returns the rows."""
    graph, config = GRAPHS[routing]
    args.variant = routing
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    ready = tmp / "ready.json"
    env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
    env["DYN_LOG"] = "error"
    serve = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli.main", "serve", graph,
         "-f", config, f"--Worker.replicas={args.workers}",
         f"--Worker.engine_args.speedup_ratio={args.speedup}", "--Frontend.port=0",
         "--Frontend.replicas=1",  # one frontend process on both sides
         "--Common.log_level=warning", "--no-status", "--ready-file", str(ready),
         "--state-dir", str(tmp / "state")],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"graph {graph} did not come up")
            time.sleep(0.2)
        rows = json.loads(ready.read_text())["rows"]
        url = next(r["endpoint"] for r in rows if r["component"] == "Frontend")
        info = json.loads(next((tmp / "state/supervisors").glob("*.json")).read_text())
        results = asyncio.run(measure(args, url, info["etcd"], info["nats"]))
        return [{"routing": routing, **r} for r in results]
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[25, 50, 100, 150, 200])
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--speedup", type=float, default=10000)
    p.add_argument("--routing", nargs="+", choices=sorted(GRAPHS), default=["router"],
                   help="router: graphs.agg_router (route RPC to the Router process); "
                        "in_process: graphs.agg with routing in the frontend; both: one "
                        "after the other")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/router_overhead.json"))
    args = p.parse_args()
    results = [row for routing in args.routing for row in run_variant(args, routing)]
    settings = {k: v for k, v in vars(args).items() if k != "variant"}
    payload = {"benchmark": "router_overhead", "settings": settings,
               "machine": {"cpus": os.cpu_count()}, "results": results,
               "command": "python " + " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
