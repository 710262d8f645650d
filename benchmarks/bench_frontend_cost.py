"""The frontend's own cost on long prompts: this project's frontend against Dynamo's.

Both frontends serve the same kind of fleet (4 simulated SGLang workers, Dynamo's mocker,
at ``--speedup`` 100 so that the engines are never the limit).  The load is open loop:
``/v1/completions`` with ~``--prompt-tokens``-token prompts (unique per request, so
nothing is cached anywhere) and ``max_tokens`` 1, at ``--rate`` requests per second for
``--seconds``.  Measured per run: the CPU time of the frontend's process tree (user +
system from ``/proc``, before and after the load), latency percentiles, refusals; derived:
CPU-ms per request and prompt tokens per CPU-second.  Each side is started once and run
``--rounds`` times; the table gives each run and the median.

    python benchmarks/bench_frontend_cost.py                      # both sides, 3 rounds
    python benchmarks/bench_frontend_cost.py --sides splitserve --rounds 1 --profile out.txt

``--profile`` records this project's frontend with py-spy during the first round (when
py-spy is installed) and writes the top functions by own time.  Writes
``benchmarks/results/frontend_cost.json``.  Everything binds 127.0.0.1 and every process
started is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from compare import MODEL, WorkersRun, dynamo_frontend, wait_serving  # noqa: E402
from splitserve.bench.graphrun import GraphRun  # noqa: E402

WORDS = ("harbour lantern quiet river orbit velvet copper meadow signal thunder cedar "
         "pixel marble falcon ember glacier violet canyon saddle beacon").split()
CLK = os.sysconf("SC_CLK_TCK")


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    out, todo, seen = [], [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return out


def _cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a ``stat`` file (0 when it is gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (each process's
    own count, its ended threads included)."""
    return sum(_cpu_s(Path(f"/proc/{p}/stat")) for p in tree_pids(pid))


def tree_threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of every live thread of ``pid`` and its live descendants, summed by
    thread name (``comm``: the interpreter's own threads share the process's name,
    Dynamo's runtime threads are ``tokio-rt-worker``)."""
    out: dict[str, float] = {}
    for p in tree_pids(pid):
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
            except OSError:
                continue
            out[name] = out.get(name, 0.0) + _cpu_s(task / "stat")
    return out


def prompt(i: int, words: int, rng: random.Random) -> str:
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def body_of(i: int, words: int, rng: random.Random, tools: int) -> tuple[str, dict]:
    """``/v1/completions`` with one output token, or (``tools`` > 0) a chat request with
    tools and tool_choice auto whose ``tools``-token answer goes through the tool-call
    parser."""
    if not tools:
        return "/v1/completions", {"model": MODEL, "prompt": prompt(i, words, rng),
                                   "max_tokens": 1}
    return "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": prompt(i, words, rng)}],
        "tools": TOOLS, "tool_choice": "auto", "max_tokens": tools}


async def load(url: str, rate: float, seconds: float, words: int, seed: int,
               tools: int = 0) -> list[dict]:
    import aiohttp

    rng = random.Random(seed)
    bodies = [body_of(i, words, rng, tools) for i in range(int(rate * seconds))]

    async def one(s: aiohttp.ClientSession, path_body: tuple[str, dict]) -> dict:
        path, body = path_body
        t0 = time.perf_counter()
        try:
            async with s.post(f"{url}{path}", json=body) as r:
                data = await r.json(content_type=None)
                out = {"status": r.status, "s": time.perf_counter() - t0}
                if r.status == 200:
                    out["prompt_tokens"] = data["usage"]["prompt_tokens"]
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"status": type(exc).__name__, "s": time.perf_counter() - t0}

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks, start = [], time.perf_counter()
        for i, body in enumerate(bodies):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(s, body)))
        return await asyncio.gather(*tasks)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one_round(url: str, pid: int, args, seed: int) -> dict:
    c0, th0 = tree_cpu_s(pid), tree_threads_cpu_s(pid)
    t0 = time.monotonic()
    res = asyncio.run(load(url, args.rate, args.seconds, args.words, seed, args.tools))
    wall = time.monotonic() - t0
    cpu = tree_cpu_s(pid) - c0
    th1 = tree_threads_cpu_s(pid)
    by_thread = {k: round(v - th0.get(k, 0.0), 2) for k, v in th1.items()
                 if v - th0.get(k, 0.0) >= 0.01}
    ok = [r for r in res if r["status"] == 200]
    lat = [r["s"] for r in ok]
    tokens = sum(r["prompt_tokens"] for r in ok)
    refused: dict[str, int] = {}
    for r in res:
        if r["status"] != 200:
            refused[str(r["status"])] = refused.get(str(r["status"]), 0) + 1
    return {"sent": len(res), "ok": len(ok), "refused": refused, "wall_s": round(wall, 2),
            "frontend_cpu_s": round(cpu, 3),
            "cpu_ms_per_request": round(cpu * 1000 / max(1, len(ok)), 2),
            "prompt_tokens_per_cpu_s": round(tokens / cpu) if cpu > 0 else None,
            "mean_prompt_tokens": round(tokens / max(1, len(ok))),
            "latency_p50_ms": round(1000 * pct(lat, 0.5), 1) if lat else None,
            "latency_p99_ms": round(1000 * pct(lat, 0.99), 1) if lat else None,
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "cpu_s_by_thread": dict(sorted(by_thread.items(), key=lambda kv: -kv[1]))}


def profile(pid: int, seconds: float, out: Path, native: bool,
            rate: int = 100) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy is not installed: no profile", flush=True)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--format", "raw", "--output", str(out), "--nonblocking",
                             "--rate", str(rate),
                             "--threads", *(["--native"] if native else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def top_frames(raw: Path, n: int = 30) -> list[tuple[str, int]]:
    """Own-time samples per function from py-spy's collapsed stacks (the leaf frame)."""
    own: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        own[leaf] = own.get(leaf, 0) + int(count)
    return sorted(own.items(), key=lambda kv: -kv[1])[:n]


def run_side(side: str, args) -> dict:
    overrides = ["--Worker.replicas=4", f"--Worker.engine_args.speedup_ratio={args.speedup}"]
    report: dict = {"side": side, "rounds": []}
    if side == "splitserve":
        # One frontend process (the config runs two): the cost of a process, per request.
        g = GraphRun("graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml",
                     [*overrides, "--Frontend.replicas=1", *args.splitserve_overrides])
        with g:
            wait_serving(g.url, 60, 8)
            pid = next(r["pid"] for r in g.replicas("Frontend"))
            rounds(report, g.url, pid, args)
        return report
    w = WorkersRun("graphs.agg_router:Worker", "configs/mocker_agg_router.yaml", overrides)
    with w:
        fe, url = dynamo_frontend(w, "kv", shlex.split(args.dynamo_args))
        try:
            wait_serving(url, 90, 8, fe)
            rounds(report, url, fe.proc.pid, args)
        finally:
            fe.stop()
    return report


def rounds(report: dict, url: str, pid: int, args) -> None:
    for i in range(args.rounds):
        spy = None
        if args.profile and i == args.profile_round and report["side"] == "splitserve":
            spy = profile(pid, args.seconds, Path(args.profile).with_suffix(".raw"),
                          args.native, args.profile_rate)
        r = one_round(url, pid, args, seed=1000 * i)
        if spy is not None:
            spy.wait(60)
            raw = Path(args.profile).with_suffix(".raw")
            if raw.exists():
                lines = [f"{c:6d}  {f}" for f, c in top_frames(raw)]
                Path(args.profile).write_text("\n".join(lines) + "\n")
                report["profile_top"] = lines[:15]
        print(f"[{report['side']}] round {i}: {json.dumps(r)}", flush=True)
        report["rounds"].append(r)
        time.sleep(2)
    for key in ("cpu_ms_per_request", "prompt_tokens_per_cpu_s", "latency_p50_ms",
                "latency_p99_ms"):
        vals = [r[key] for r in report["rounds"] if r[key] is not None]
        report[f"median_{key}"] = statistics.median(vals) if vals else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", nargs="+", default=["dynamo", "splitserve"],
                   choices=["dynamo", "splitserve"])
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--words", type=int, default=4000, help="words per prompt (~1.2 tokens "
                   "each with this model's tokenizer)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speedup", type=float, default=100.0)
    p.add_argument("--profile", default=None, help="write py-spy's top functions here")
    p.add_argument("--profile-round", type=int, default=0, help="which round --profile "
                   "samples (round 0 includes first-use imports)")
    p.add_argument("--native", action="store_true", help="profile native frames too")
    p.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--tools", type=int, default=0, help="send chat requests with tools "
                   "(tool_choice auto) and this many output tokens, which the frontend's "
                   "tool-call parser reads, instead of one-token completions")
    p.add_argument("--splitserve-overrides", nargs="*", default=[])
    p.add_argument("--dynamo-args", default="", help="more flags of Dynamo's frontend, one "
                   "string (e.g. \"--chat-processor vllm --tool-call-parser hermes "
                   "--enable-auto-tool-choice\": its tool calls parsed by vLLM's parser "
                   "in its own process)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/frontend_cost.json"))
    args = p.parse_args(argv)
    out = {"command": "python benchmarks/bench_frontend_cost.py " + " ".join(argv or sys.argv[1:]),
           "rate": args.rate, "seconds": args.seconds, "words": args.words, "tools": args.tools,
           "cpus": os.cpu_count(), "sides": [run_side(s, args) for s in args.sides]}
    sides = {s["side"]: s for s in out["sides"]}
    if len(sides) == 2:
        ours, theirs = sides["splitserve"], sides["dynamo"]
        out["ratio_tokens_per_cpu_s"] = round(ours["median_prompt_tokens_per_cpu_s"]
                                              / theirs["median_prompt_tokens_per_cpu_s"], 3)
        out["ratio_latency_p99"] = round(ours["median_latency_p99_ms"]
                                         / theirs["median_latency_p99_ms"], 3)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "sides"}, indent=2))
    for s in out["sides"]:
        print(s["side"], {k: v for k, v in s.items() if k.startswith("median")})


if __name__ == "__main__":
    main()
