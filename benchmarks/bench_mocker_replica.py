"""Latency and throughput of one mocker replica through a direct Dynamo client call.

``python benchmarks/bench_mocker_replica.py [--engine-type sglang] ...``
starts embedded etcd + NATS and one mocker Worker replica (through its component
entry point, as the supervisor would), then measures:

* sequential requests: end-to-end latency and time to first token, p50/p99;
* ``--concurrency`` requests in flight: requests/s and output tokens/s;
* resident memory of the engine process and of the component wrapper.

It prints one JSON object.  Everything it starts is stopped by pid on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitserve.infra.embedded import EmbeddedInfra
from splitserve.contracts.kit.procs import kill_pid
from splitserve.contracts.config import CommonConfig
from splitserve.contracts.config import ComponentRunConfig

NS = "mockbench"


def rss_mib(pid: int) -> float:
    """Resident set size of a process in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in [0, 100])."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def one(client, instance_id: int, prompt: list[int], max_tokens: int
              ) -> tuple[float, float, int]:
    """Send one request; return (latency s, time to first token s, tokens received)."""
    req = {"model": "bench", "token_ids": prompt, "stop_conditions": {"max_tokens": max_tokens},
           "sampling_options": {}, "output_options": {}, "eos_token_ids": [2]}
    t0 = time.perf_counter()
    ttft, n = 0.0, 0
    async for item in await client.direct(req, instance_id):
        toks = item.data()["token_ids"]
        if toks and n == 0:
            ttft = time.perf_counter() - t0
        n += len(toks)
    return time.perf_counter() - t0, ttft, n


async def measure(args, instance_id: int) -> dict:
    from dynamo.runtime import DistributedRuntime

    rt = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp", event_plane="nats")
    try:
        client = await rt.endpoint(f"{NS}.worker.generate").client()
        await client.wait_for_instances()
        # Distinct prompts so prefix caching does not make later requests cheaper.
        prompts = [[10_000 + i] + list(range(1, args.prompt_tokens)) for i in range(100_000)]
        for i in range(20):  # warm-up
            await one(client, instance_id, prompts[i], args.max_tokens)
        lat, ttft = [], []
        for i in range(args.requests):
            total, first, _ = await one(client, instance_id, prompts[100 + i], args.max_tokens)
            lat.append(total * 1000)
            ttft.append(first * 1000)

        queue = iter(range(1000, 1000 + args.concurrent_requests))
        done_tokens = 0

        async def lane() -> None:
            nonlocal done_tokens
            for i in queue:
                _, _, n = await one(client, instance_id, prompts[i], args.max_tokens)
                done_tokens += n

        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        return {
            "sequential": {"requests": args.requests,
                           "latency_ms_p50": round(pct(lat, 50), 2),
                           "latency_ms_p99": round(pct(lat, 99), 2),
                           "ttft_ms_p50": round(pct(ttft, 50), 2),
                           "ttft_ms_p99": round(pct(ttft, 99), 2)},
            "concurrent": {"concurrency": args.concurrency,
                           "requests": args.concurrent_requests,
                           "wall_s": round(wall, 2),
                           "requests_per_s": round(args.concurrent_requests / wall, 1),
                           "output_tokens_per_s": round(done_tokens / wall, 1)},
        }
    finally:
        rt.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-type", default="sglang", choices=["sglang", "trtllm", "vllm"])
    p.add_argument("--speedup-ratio", type=float, default=1000.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--concurrent-requests", type=int, default=2000)
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="mockbench-") as tmp, \
            EmbeddedInfra(Path(tmp) / "infra") as ep:
        os.environ.update(ep.env())
        os.environ.setdefault("DYN_TCP_RPC_HOST", "127.0.0.1")
        status = Path(tmp) / "status.json"
        cfg = ComponentRunConfig(
            component="Worker", replica=0, common=CommonConfig(namespace=NS, log_level="warning"),
            config={"engine": "mocker", "engine_args": {"engine_type": args.engine_type,
                                                       "speedup_ratio": args.speedup_ratio}},
            links=[], status_file=str(status))
        (Path(tmp) / "w.json").write_text(cfg.model_dump_json())
        env = {**os.environ, "DYN_LOG": "error"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.components.worker.main",
             "--config", str(Path(tmp) / "w.json")], env=env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engine_pid = None
        try:
            deadline = time.monotonic() + 120
            state: dict = {}
            while state.get("state") != "ready":
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker did not become ready ({proc.returncode})")
                time.sleep(0.1)
                try:
                    state = json.loads(status.read_text())
                except (OSError, ValueError):
                    state = {}
            engine_pid = state["engine_pid"]
            idle = {"engine_rss_mib": round(rss_mib(engine_pid), 1),
                    "component_rss_mib": round(rss_mib(proc.pid), 1)}
            result = asyncio.run(measure(args, state["instance_id"]))
            result["memory_idle"] = idle
            result["memory_after"] = {"engine_rss_mib": round(rss_mib(engine_pid), 1)}
            result["settings"] = vars(args)
            print(json.dumps(result, indent=2))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            for pid in (proc.pid, engine_pid):
                if pid:
                    kill_pid(pid, 2.0)


if __name__ == "__main__":
    main()
