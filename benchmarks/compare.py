"""This project against Dynamo's own frontend (and sglang-router) on the same mocker fleet.

One command, one machine, one configuration after another, each over the **same fleet
settings** (simulated SGLang engines — Dynamo's mocker, ``engine_type: sglang`` — N
workers, the same speedup, block size and KV capacity), the **same trace window**, the
**same token/time scaling**, the **same load points** and the **same SLOs**:

- ``splitserve-agg-kv``: ``graphs.agg_router:Frontend`` with ``configs/mocker_agg_router.yaml``
  (this project's frontend and KV-aware router, N agg workers);
- ``splitserve-admission``: the same graph with admission on (docs/qos.md): the default
  class is rejectable with a TTFT target (``--admission-ttft-ms``) and the router's
  admission queue caps each worker at ``--admission-queue-per-worker`` requests;
- ``splitserve-admission-inproc``: admission on as above with the routing service inside
  the frontend process (``graphs.agg:Frontend`` with ``configs/mocker_agg_inproc.yaml``:
  the same fleet, no Router process, one hop fewer per request);
- ``splitserve-disagg``: ``graphs.disagg:Frontend`` with ``configs/mocker_disagg.yaml``
  (this project's frontend, router, score-based offload decider and prefill queue;
  N/2 decode + N/2 prefill workers);
- ``dynamo-round-robin`` / ``dynamo-kv``: only the workers of ``graphs.agg_router``
  (``dynamo serve graphs.agg_router:Worker``, N agg workers with embedded etcd/NATS),
  and ``python -m dynamo.frontend --router-mode round-robin|kv`` pointed at that run's
  etcd and NATS: it discovers the model card the mocker workers register and routes to
  them over Dynamo's TCP request plane;
- ``sglang-router-cache-aware``: sglang-router drives SGLang HTTP servers (``/generate``,
  ``/health``, ``/server_info`` ...) or SGLang/vLLM gRPC schedulers.  The mocker workers
  serve neither — only Dynamo's msgpack-over-TCP request plane — so this row is a probe,
  run against the dynamo-kv fleet: it records what sglang-router does when given the
  workers' addresses (it cannot register them) instead of a measurement.

For each configuration: start it on free loopback ports, wait until a run of warm-up
requests succeeds, then for each load (``--rate-scales``: multipliers of the trace's
request rate) replay the window open loop (``splitserve.bench.replay``) with the block
token seed ``seed + i`` for the i-th load (fresh prefixes per load, so one load cannot
hit the previous load's cached prefixes; within a load the trace's prefix sharing is
kept), pause, and finally stop everything it started (by process group and pid).

    python benchmarks/compare.py                 # defaults: see --help; ~10-15 minutes
    python benchmarks/compare.py --configs dynamo-kv --rate-scales 4   # one piece

The goodput sweep (``--loads``) offers multiples of the fleet's capacity
(``--capacity-rps``) instead of multiples of the trace's rate: each multiple gets a trace
window long enough to last ``--window-s`` of wall time, ``--sustained-s`` from
``--sustained-from`` times capacity up (benchmarks/sweep_plan.py); goodput is over the
makespan (first send to last answer, drain included).  It writes
``benchmarks/results/goodput_sweep.json`` and ``goodput_sweep.png`` and checks the goals
against ``dynamo-kv``:

    python benchmarks/compare.py --loads 0.5,1,1.5,2,2.5,3 \
        --configs splitserve-admission dynamo-round-robin dynamo-kv

Writes ``benchmarks/results/compare.json`` and PNGs ``benchmarks/results/compare_*.png``
and prints the per-point table and the ratio table (this project ÷ the best other).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import sweep_plan as sp
from splitserve.bench.graphrun import GraphRun
from splitserve.contracts.kit.component import SKIP_SGLANG_LOGGING

from splitserve.bench import replay as rp
from splitserve.bench import sweep as sw

OURS = ["splitserve-agg-kv", "splitserve-admission", "splitserve-admission-inproc",
        "splitserve-disagg"]
OTHERS = ["dynamo-round-robin", "dynamo-kv"]
SGLANG = "sglang-router-cache-aware"
ALL = [*OURS, *OTHERS, SGLANG]
HOST = "127.0.0.1"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ---- deployments ------------------------------------------------------------------------
class WorkersRun(GraphRun):
    """``dynamo serve graphs.agg_router:Worker``: mocker workers and embedded etcd/NATS,
    no frontend.  ``etcd`` / ``nats`` are that run's endpoints."""

    serves_http = False

    def _after_ready(self) -> None:
        infra = json.loads((Path(self.info()["run_dir"]) / "infra" / "infra.json").read_text())
        self.etcd, self.nats = infra["endpoints"]["etcd"], infra["endpoints"]["nats"]
        self.seen_pids |= set(infra.get("pids", {}).values())

    def instances(self) -> list[dict]:
        """The workers' registrations in etcd (``v1/instances/<ns>/worker/generate``)."""
        etcdctl = shutil.which("etcdctl") or str(Path(sys.executable).parent / "etcdctl")
        out = subprocess.run([etcdctl, f"--endpoints={self.etcd}", "get", "--prefix",
                              "v1/instances/dynamo/worker/generate", "--print-value-only"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]


class Proc:
    """A subprocess in its own process group, stopped by group (TERM, then KILL)."""

    def __init__(self, argv: list[str], env: dict, log: Path) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


def dynamo_env(workers: WorkersRun) -> dict[str, str]:
    """The environment of a Dynamo process joining ``workers``' etcd and NATS, every
    listener it opens on loopback."""
    return {**os.environ, "ETCD_ENDPOINTS": workers.etcd, "NATS_SERVER": workers.nats,
            "DYN_LOG": "error", "DYN_TCP_RPC_HOST": HOST, "DYN_HTTP_RPC_HOST": HOST,
            "DYN_SYSTEM_HOST": HOST, SKIP_SGLANG_LOGGING: "1"}


def dynamo_frontend(workers: WorkersRun, mode: str, extra: list[str] | tuple[str, ...] = (),
                    log_name: str | None = None) -> tuple[Proc, str]:
    """Dynamo's frontend in ``mode`` over ``workers``' etcd and NATS, on a free loopback
    port; ``extra``: more of its flags (busy-worker thresholds, router queue)."""
    port = free_port()
    env = dynamo_env(workers)
    proc = Proc([sys.executable, "-m", "dynamo.frontend", "--http-host", HOST, "--http-port",
                 str(port), "--router-mode", mode, "--namespace", "dynamo",
                 "--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "nats",
                 *extra], env, workers.tmp / (log_name or f"frontend-{mode}.log"))
    return proc, f"http://{HOST}:{port}"


def wait_serving(url: str, timeout_s: float, streak_needed: int, proc: Proc | None = None) -> int:
    """Until ``streak_needed`` requests in a row succeed (blocks of their own); returns how
    many were sent."""
    import httpx

    streak, sent, deadline = 0, 0, time.monotonic() + timeout_s
    while streak < streak_needed:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"frontend exited:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not serving within {timeout_s:.0f}s")
        body = {"model": MODEL, "prompt": [1000 + sent, 2000 + sent, 3000 + sent, 4000],
                "max_tokens": 2}
        try:
            ok = httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
        except httpx.HTTPError:
            ok = False
        sent += 1
        streak = streak + 1 if ok else 0
        if not ok:
            time.sleep(0.5)
    return sent


def probe_sglang_router(workers: WorkersRun, wait_s: float = 45) -> dict:
    """Point sglang-router (cache_aware) at the mocker workers' request-plane addresses and
    record what happens.  Never a measurement: see the module docstring."""
    out: dict = {"config": SGLANG, "measured": False}
    try:
        out["sglang_router_version"] = md.version("sglang-router")
    except md.PackageNotFoundError:
        out["reason"] = ("sglang-router is not installed (pip install sglang-router); and it "
                         "could not drive these workers anyway (below)")
    addrs = []
    for inst in workers.instances():
        tcp = inst.get("transport", {}).get("tcp", "")
        addrs.append(tcp.split("/", 1)[0])
    out["worker_addresses"] = addrs
    import httpx

    probes = {}
    for path in ("/health", "/server_info", "/get_server_info", "/model_info", "/generate",
                 "/v1/models"):
        try:
            r = httpx.get(f"http://{addrs[0]}{path}", timeout=2)  # a TCP port, not HTTP
            probes[path] = r.status_code
        except httpx.HTTPError as exc:
            probes[path] = type(exc).__name__
    out["http_probe_of_first_worker"] = probes
    if "sglang_router_version" not in out:
        return out
    port = free_port()
    proc = Proc([sys.executable, "-m", "sglang_router.launch_router", "--host", HOST, "--port",
                 str(port), "--policy", "cache_aware", "--worker-startup-timeout-secs", "8",
                 "--log-level", "warn", "--worker-urls", *[f"http://{a}" for a in addrs]],
                dict(os.environ), workers.tmp / "sglang-router.log")
    t0 = time.monotonic()
    failed: list[str] = []
    try:
        while time.monotonic() - t0 < wait_s and proc.alive():  # until registration gives up
            failed = [ANSI.sub("", ln).strip() for ln in proc.tail(50000).splitlines()
                      if "Failed job" in ln]
            if len(failed) >= len(addrs):
                break
            time.sleep(1)
        out["waited_s"] = round(time.monotonic() - t0, 1)
        out["router_log_excerpt"] = failed[:4]
        try:
            r = httpx.post(f"http://{HOST}:{port}/v1/completions",
                           json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, timeout=5)
            out["completion_via_router"] = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            out["completion_via_router"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        proc.stop()
    out["reason"] = (
        "sglang-router registers a worker only after reaching it over HTTP (health check "
        "/health, metadata /server_info or /get_server_info and /model_info, requests to "
        "/generate or the OpenAI routes, load from /get_load) or over SGLang/vLLM gRPC. The "
        "mocker workers serve Dynamo's msgpack request plane over raw TCP and no HTTP "
        "endpoint, so every worker fails sglang-router's connection-mode detection "
        "(detect_connection_mode) and the router has no worker to send to.")
    return out


def admission_overrides(args, section: str = "Router") -> list[str]:
    """Admission on (docs/qos.md, "Admission on"): every request is in the rejectable
    default class with the SLO's TPOT and ``--admission-ttft-ms``, no slack, and the
    router's admission queue when ``--admission-queue-per-worker`` > 0.  ``section``:
    where the routing settings live (``Frontend.router`` when routing in process)."""
    cls = (f"[{{name: default, ttft_ms: {args.admission_ttft_ms:g}, tpot_ms: "
           f"{rp.parse_slo(args.slo).get('tpot_ms', 50):g}, may_reject: true, "
           "may_degrade: false}]")
    out = [f"--{section}.qos.classes={cls}", f"--{section}.qos.low_priority_threshold_ms=0"]
    if args.admission_queue_per_worker > 0:
        out.append(f"--{section}.qos.queue.max_inflight_per_worker="
                   f"{args.admission_queue_per_worker}")
    return out


@contextlib.contextmanager
def deployment(name: str, args, report: dict):
    """Start configuration ``name``; yields its base URL (and the WorkersRun, if any)."""
    n, s = args.workers, args.speedup
    t0 = time.monotonic()
    if name in ("splitserve-agg-kv", "splitserve-admission", "splitserve-admission-inproc"):
        inproc = name == "splitserve-admission-inproc"
        extra = (admission_overrides(args, "Frontend.router" if inproc else "Router")
                 if name != "splitserve-agg-kv" else [])
        graph, config = (("graphs.agg:Frontend", "configs/mocker_agg_inproc.yaml") if inproc
                         else ("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml"))
        g = GraphRun(graph, config,
                     [f"--Worker.replicas={n}", f"--Worker.engine_args.speedup_ratio={s}",
                      "--Frontend.replicas=1", *extra],  # one process, as recorded before
                     startup_timeout_s=args.startup_timeout_s)
        with g:
            report["startup_s"] = time.monotonic() - t0
            report["warmup_requests"] = wait_serving(g.url, 60, 2 * n)
            yield g.url, None
        return
    if name == "splitserve-disagg":
        half = max(1, n // 2)
        g = GraphRun("graphs.disagg:Frontend", "configs/mocker_disagg.yaml",
                     [f"--DecodeWorker.replicas={half}", f"--PrefillWorker.replicas={half}",
                      f"--DecodeWorker.engine_args.speedup_ratio={s}",
                      f"--PrefillWorker.engine_args.speedup_ratio={s}"],
                     startup_timeout_s=args.startup_timeout_s)
        with g:
            report["startup_s"] = time.monotonic() - t0
            report["warmup_requests"] = wait_serving(g.url, 60, 2 * n)
            yield g.url, None
        return
    if name in ("dynamo-round-robin", "dynamo-kv"):
        mode = "round-robin" if name == "dynamo-round-robin" else "kv"
        w = WorkersRun("graphs.agg_router:Worker", "configs/mocker_agg_router.yaml",
                       [f"--Worker.replicas={n}", f"--Worker.engine_args.speedup_ratio={s}"],
                       startup_timeout_s=args.startup_timeout_s)
        with w:
            fe, url = dynamo_frontend(w, mode)
            try:
                report["startup_s"] = time.monotonic() - t0
                report["warmup_requests"] = wait_serving(url, 90, 2 * n, fe)
                yield url, w
            finally:
                fe.stop()
        return
    raise ValueError(name)


# ---- the comparison ---------------------------------------------------------------------
def slim(records: list[dict]) -> list[dict]:
    keep = ("index", "outcome", "ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "output_tokens",
            "scheduled_s", "sent_s", "predicted_ttft_s")
    return [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
            for r in records]


def run_config(name: str, args, base: rp.ReplayConfig, prepared: dict) -> dict:
    report: dict = {"config": name, "points": [], "results": {}}
    t0 = time.monotonic()
    try:
        with deployment(name, args, report) as (url, workers):
            for i, rs in enumerate(args.rate_scales):
                cfg = replace(base, rate_scale=rs, seed=base.seed + i)
                reqs, workload = prepared[rs]
                deadline = workload["replay_span_s"] + args.drain_s
                la0 = os.getloadavg()[0]
                res = rp.run_replay(url, cfg, label=f"{name} x{rs:g}", progress_s=args.progress_s,
                                    deadline_s=deadline, reqs=reqs, workload=workload)
                rp.print_summary(res["summary"], f"{name} x{rs:g}")
                point = sw.point_from_result(res, name, rs)
                point["capacity_multiple"] = args.multiple_of.get(rs)
                point["loadavg_1m"] = [round(la0, 2), round(os.getloadavg()[0], 2)]
                report["points"].append(point)
                report["results"][f"x{rs:g}"] = {"summary": res["summary"],
                                                 "requests": slim(res["requests"])}
                time.sleep(args.pause_s)
            if name == "dynamo-kv" and SGLANG in args.configs and workers is not None:
                report["sglang_probe"] = probe_sglang_router(workers)
    except Exception as exc:  # noqa: BLE001 - record it, go on with the next configuration
        report["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        print(f"[{name}] FAILED: {report['error']}", flush=True)
    report["wall_s"] = time.monotonic() - t0
    return report


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "gpu": None,
            "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for pkg in ("splitserve", "ai-dynamo", "ai-dynamo-runtime", "sglang-router", "aiohttp",
                "matplotlib"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=ALL, choices=ALL)
    p.add_argument("--workers", type=int, default=4, help="mocker workers per configuration")
    p.add_argument("--speedup", type=float, default=1.0, help="mocker speedup_ratio")
    p.add_argument("--trace", default=rp.DEFAULT_TRACE)
    p.add_argument("--start-s", type=float, default=0.0)
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--rate-scales", type=sw.parse_rate_scales, default=[4.0, 8.0, 16.0, 32.0])
    p.add_argument("--token-scale", type=int, default=4)
    p.add_argument("--output-scale", type=float, default=16.0)
    p.add_argument("--context", type=int, default=rp.DEFAULT_CONTEXT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default="ttft=1000,tpot=50")
    p.add_argument("--drain-s", type=float, default=40.0,
                   help="after the last send, cancel what still runs after this long")
    p.add_argument("--pause-s", type=float, default=3.0)
    p.add_argument("--progress-s", type=float, default=10.0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--startup-timeout-s", type=float, default=180.0)
    p.add_argument("--loads", type=sp.parse_multiples, default=None,
                   help="goodput sweep: offered loads as multiples of --capacity-rps "
                        "(replaces --rate-scales and --duration-s)")
    p.add_argument("--capacity-rps", type=float, default=40.0,
                   help="the fleet's capacity: the default is the 4-worker fleet's peak "
                        "goodput in the trace-rate comparison (docs/results/README.md)")
    p.add_argument("--window-s", type=float, default=15.0,
                   help="sweep: wall seconds of arrivals at loads below --sustained-from")
    p.add_argument("--sustained-s", type=float, default=60.0,
                   help="sweep: wall seconds of arrivals at the top loads")
    p.add_argument("--sustained-from", type=float, default=2.0)
    p.add_argument("--admission-ttft-ms", type=float, default=1000.0,
                   help="splitserve-admission: the default class's TTFT target")
    p.add_argument("--admission-queue-per-worker", type=int, default=8,
                   help="splitserve-admission: the router queue's per-worker cap (0: off)")
    p.add_argument("--out", default=None, help="default benchmarks/results/compare.json, "
                   "goodput_sweep.json with --loads")
    p.add_argument("--plots", default=str(REPO / "benchmarks/results"),
                   help="directory for compare_*.png / goodput_sweep.png")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(REPO / "benchmarks/results" /
                       ("goodput_sweep.json" if args.loads else "compare.json"))
    return args


def prepare_workloads(args: argparse.Namespace) -> tuple[rp.ReplayConfig, dict]:
    """The replay settings and, per rate scale, the identical requests every
    configuration gets; a sweep (``--loads``) sets the rate scales and durations."""
    base = rp.ReplayConfig(trace=args.trace, start_s=args.start_s, duration_s=args.duration_s,
                           token_scale=args.token_scale, output_scale=args.output_scale,
                           context=args.context, seed=args.seed, slo=rp.parse_slo(args.slo),
                           timeout_s=args.request_timeout, model=MODEL)
    durations: dict[float, float | None] = {}
    args.multiple_of = {}
    if args.loads:
        rows = rp.load_trace(rp.resolve_trace(args.trace))
        arrivals = [r.t_s - args.start_s for r in rows if r.t_s >= args.start_s]
        plan = sp.plan_loads(arrivals, args.capacity_rps, args.loads, args.window_s,
                             args.sustained_s, args.sustained_from)
        args.rate_scales = [round(pt.rate_scale, 3) for pt in plan]
        durations = {round(pt.rate_scale, 3): pt.duration_trace_s for pt in plan}
        args.multiple_of = {round(pt.rate_scale, 3): pt.multiple for pt in plan}
    prepared = {}
    for i, rs in enumerate(args.rate_scales):  # identical requests for every configuration
        prepared[rs] = rp.prepare(replace(base, rate_scale=rs, seed=base.seed + i,
                                          duration_s=durations.get(rs, base.duration_s)))
    w = prepared[args.rate_scales[0]][1]
    print(f"window: {w['window_requests']} requests, trace {w['window_trace_s'][0]:.0f}-"
          f"{w['window_trace_s'][1]:.0f}s; prompt tokens p50 {w['prompt_tokens']['p50']:.0f} "
          f"p99 {w['prompt_tokens']['p99']:.0f}; loads "
          + ", ".join(f"x{rs:g} = {prepared[rs][1]['offered_rps']:.1f} req/s"
                      for rs in args.rate_scales), flush=True)
    return base, prepared


def write_plots(args: argparse.Namespace, base: rp.ReplayConfig, prepared: dict,
                reports: dict, points: list) -> None:
    """The PNG plots of the run (none when matplotlib is missing)."""
    try:
        from splitserve.bench.plots import plot_latency_cdfs, plot_sweep
    except ImportError as exc:  # matplotlib missing: results are still written
        print(f"no plots: {exc}")
        return
    plots = Path(args.plots)
    title = (f"{Path(args.trace).name} [{args.start_s:g}, {args.start_s + args.duration_s:g}) s, "
             f"tokens /{args.token_scale}, outputs /{args.output_scale:g}; {args.workers} mocker "
             f"workers (sglang, speedup {args.speedup:g})")
    if args.loads:
        title = (f"{Path(args.trace).name}, {', '.join(f'{m:g}' for m in args.loads)} x "
                 f"capacity ({args.capacity_rps:g} req/s); tokens /{args.token_scale}, outputs "
                 f"/{args.output_scale:g}; {args.workers} mocker workers (sglang)")
        print(f"wrote {plot_sweep(points, plots / 'goodput_sweep.png', title=title, slo=base.slo)}")
        return
    written = [plot_sweep(points, plots / "compare_sweep.png", title=title, slo=base.slo)]
    for rs in args.rate_scales:
        res = {c: r["results"][f"x{rs:g}"] for c, r in reports.items()
               if f"x{rs:g}" in r.get("results", {})}
        if res:
            written.append(plot_latency_cdfs(
                res, plots / f"compare_cdf_x{rs:g}.png", slo=base.slo,
                title=f"{title}\nrate x{rs:g} ({prepared[rs][1]['offered_rps']:.1f} req/s offered)"))
    for w_ in written:
        print(f"wrote {w_}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base, prepared = prepare_workloads(args)
    t0 = time.monotonic()
    reports = {}
    for name in args.configs:
        if name == SGLANG:
            continue
        print(f"==== {name}", flush=True)
        reports[name] = run_config(name, args, base, prepared)
    sglang = reports.get("dynamo-kv", {}).pop("sglang_probe", None)
    if SGLANG in args.configs and sglang is None:
        sglang = {"config": SGLANG, "measured": False,
                  "reason": "not probed (needs the dynamo-kv configuration in the same run)"}
    points = [pt for r in reports.values() for pt in r["points"]]
    ours = [c for c in OURS if c in reports]
    others = [c for c in OTHERS if c in reports]
    table = sw.ratio_table(points, ours, others)
    peaks = [sw.peak_ratio(points, c, others) for c in ours]
    sat = {c: sw.saturation_point(ps) for c, ps in sw.by_config(points).items()}

    print("\n" + sw.markdown_points(points))
    if table:
        print("\nthis project ÷ best other configuration at the same load:\n"
              + sw.markdown_ratios(table))
        for pk in peaks:
            print(f"peak goodput {pk['config']}: {sw.fmt(pk['peak_goodput_rps'])} req/s vs "
                  f"{pk['best_other']} {sw.fmt(pk['best_other_peak_goodput_rps'])} req/s -> "
                  f"ratio {sw.fmt(pk['ratio'])}")
    if sglang:
        print(f"\n{SGLANG}: not measured: {sglang.get('reason')}")
    goal_rows = []
    if args.loads and "dynamo-kv" in reports:
        for c in ours:
            rows_ = sp.goals(points, c, "dynamo-kv", saturated=2.0, below=1.0)
            goal_rows += [{"config": c, **r} for r in rows_]
            print(f"\ngoals, {c} vs dynamo-kv:\n" + sp.markdown_goals(rows_, c, "dynamo-kv"))

    result = {
        "command": "python " + " ".join([str(Path(__file__).relative_to(REPO)),
                                         *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(), "versions": versions(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plots")},
        "replay_config": asdict(base),
        "workloads": {f"x{rs:g}": prepared[rs][1] for rs in args.rate_scales},
        "points": points, "ratios": table, "peak_goodput_ratios": peaks,
        "saturation": {c: None if p is None else p["rate_scale"] for c, p in sat.items()},
        "sglang_router": sglang, "goals": goal_rows,
        "configs": {c: {k: v for k, v in r.items() if k != "points"} for c, r in reports.items()},
        "total_wall_s": time.monotonic() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({result['total_wall_s']:.0f}s)")
    write_plots(args, base, prepared, reports, points)


if __name__ == "__main__":
    main()
