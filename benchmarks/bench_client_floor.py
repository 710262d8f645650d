"""The floor under any Python frontend over Dynamo's runtime: what Dynamo's own Python
client costs per streamed token, with no frontend at all.

The same fleet as ``bench_frontend_cost.py`` (4 simulated SGLang workers, Dynamo's
mocker at ``--speedup`` 100, behind this project's worker shells), and a bare client in
this process: Dynamo's ``DistributedRuntime``, the workers' ``generate`` endpoint, one
request every ``1 / --rate`` seconds for ``--seconds``, each answering ``--tokens``
tokens, and nothing done with a chunk but counting its tokens.  Measured: this process's
CPU time over the load, split into the Python thread and Dynamo's runtime threads (from
``/proc``); derived: CPU-ms per request and CPU-microseconds per streamed token.  Run
once per ``--runtime-threads`` value (``DYN_RUNTIME_NUM_WORKER_THREADS``, each in a
fresh process; ``default`` leaves Dynamo's own).

Set beside ``bench_frontend_cost.py --tools N``'s figures for both frontends, it says how
much of this project's frontend's cost per chunk is the client's hand-off, which no
frontend written over that client can avoid.

    python benchmarks/bench_client_floor.py --tokens 350 --rate 20

Writes ``--out`` (JSON).  Everything binds 127.0.0.1; every process started is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CLK = os.sysconf("SC_CLK_TCK")


def threads_cpu_s() -> dict[str, float]:
    """This process's CPU seconds per thread name (user + system)."""
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK
    return out


async def load(etcd: str, nats: str, args) -> dict:
    os.environ["ETCD_ENDPOINTS"], os.environ["NATS_SERVER"] = etcd, nats
    from compare import MODEL
    from splitserve.contracts.kit.component import make_runtime
    from splitserve.contracts.wire import worker_request

    runtime = make_runtime(asyncio.get_running_loop(), "tcp")
    client = await runtime.endpoint("dynamo.worker.generate").client()
    await client.wait_for_instances()
    ids = client.instance_ids()

    async def one(i: int) -> int:
        req = worker_request(model=MODEL, token_ids=list(range(1, 300 + i % 50)),
                             max_tokens=args.tokens, temperature=None, top_p=None,
                             seed=None, eos_token_ids=[], request_id=f"floor-{i}",
                             priority="normal")
        req["stop_conditions"]["ignore_eos"] = True
        tokens = 0
        async for item in await client.direct(req, ids[i % len(ids)]):
            tokens += len(item.data().get("token_ids") or [])
        return tokens

    n = int(args.rate * args.seconds)
    before, cpu0, wall0 = threads_cpu_s(), time.process_time(), time.monotonic()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(1.0 / args.rate)
    tokens = sum(await asyncio.gather(*tasks))
    cpu = time.process_time() - cpu0
    after = threads_cpu_s()
    split = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 2) for k in after}
    return {"requests": n, "tokens": tokens, "cpu_s": round(cpu, 2),
            "cpu_ms_per_request": round(1000.0 * cpu / n, 2),
            "cpu_us_per_token": round(1e6 * cpu / max(1, tokens), 1),
            "threads_cpu_s": {k: v for k, v in split.items() if v},
            "wall_s": round(time.monotonic() - wall0, 1)}


def child(args) -> None:
    """One measured run in this process (started by ``main`` per setting)."""
    import uvloop

    from compare import WorkersRun

    overrides = ["--Worker.replicas=4", f"--Worker.engine_args.speedup_ratio={args.speedup}"]
    with WorkersRun("graphs.agg_router:Worker", "configs/mocker_agg_router.yaml",
                    overrides) as w:
        result = uvloop.run(load(w.etcd, w.nats, args))
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=350)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--speedup", type=float, default=100.0)
    p.add_argument("--runtime-threads", nargs="+", default=["1", "default"])
    p.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/client_floor.json")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for threads in args.runtime_threads:
            env = {**os.environ, "DYN_LOG": "warn"}
            env.pop("DYN_RUNTIME_NUM_WORKER_THREADS", None)
            if threads != "default":
                env["DYN_RUNTIME_NUM_WORKER_THREADS"] = threads
            argv = [sys.executable, __file__, "--child", f"--tokens={args.tokens}",
                    f"--rate={args.rate}", f"--seconds={args.seconds}",
                    f"--speedup={args.speedup}"]
            out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                                 timeout=args.seconds + 240)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"run failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            run = {"runtime_threads": threads, "round": rnd, **json.loads(line[7:])}
            print(json.dumps(run), flush=True)
            runs.append(run)
    summary = {t: statistics.median(r["cpu_us_per_token"] for r in runs
                                    if r["runtime_threads"] == t)
               for t in args.runtime_threads}
    report = {"command": "python benchmarks/bench_client_floor.py " + " ".join(sys.argv[1:]),
              "tokens": args.tokens, "rate": args.rate, "seconds": args.seconds,
              "cpus": os.cpu_count(), "runs": runs,
              "median_cpu_us_per_token": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
