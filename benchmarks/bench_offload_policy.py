"""Offload policy on a replayed Mooncake conversation trace, simulated SGLang fleet.

For each load point (``--time-scales``: the first 120 s of the trace at 2x and 4x its
request rate by default) and each policy, one after the other, brings ``graphs.disagg:Frontend`` up with
``configs/mocker_disagg.yaml`` (2 prefill + 2 decode mocker workers, sglang engine type,
speedup 1 = real-time simulation), replays the same trace window through
``benchmarks/trace_replay.py`` (open loop, streaming ``/v1/completions`` with token-id
prompts), reads the decode workers' ``splitserve_disagg_decisions_total`` and
``splitserve_disagg_fallbacks_total``, and stops the graph.  Policies:

- ``score``: the seed's score-based policy as configured (remote iff prompt >= 256
  tokens and prefill queue depth < 10);
- ``local``: ``decider: forced, remote: false`` (every prefill on the decode worker);
- ``remote``: ``decider: forced, remote: true`` (every prefill on the prefill pool).

Prints a comparison table and writes ``benchmarks/results/offload_policy.json``.

    python benchmarks/bench_offload_policy.py            # defaults: see --help

Token scaling: prompts, the 512-token trace block and outputs are divided by 16 (the
served context is 8,192 tokens); figures are for the scaled trace.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trace_replay as tr
from splitserve.bench.graphrun import GraphRun

REPO = Path(__file__).resolve().parents[1]
GRAPH = "graphs.disagg:Frontend"
CONFIG = "configs/mocker_disagg.yaml"
DECISIONS = "splitserve_disagg_decisions_total"
FALLBACKS = "splitserve_disagg_fallbacks_total"

POLICIES = {
    "score": [],  # as configured
    "local": [("--DecodeWorker.disaggregated_router="
              "{enable: true, decider: forced, remote: false}")],
    "remote": [("--DecodeWorker.disaggregated_router="
               "{enable: true, decider: forced, remote: true}")],
}


def fleet_overrides(args) -> list[str]:
    out = []
    for comp in ("DecodeWorker", "PrefillWorker"):
        out.append(f"--{comp}.engine_args.speedup_ratio={args.speedup}")
    out.append(f"--PrefillWorker.engine_args.kv_transfer_bandwidth={args.kv_bandwidth}")
    return out


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for pkg in ("splitserve", "ai-dynamo", "ai-dynamo-runtime", "aiohttp"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def warm_up(url: str, cfg: tr.ReplayConfig, n: int) -> None:
    """A few requests with blocks of their own (a different seed), not measured, so the
    first measured requests do not pay for lazy set-up (queue consumers, connections)."""
    if n <= 0:
        return
    scaling = tr.TokenScaling(cfg.token_scale, cfg.output_scale, cfg.context, cfg.max_output)
    blocks = tr.BlockTokens(scaling.block_tokens, seed=cfg.seed + 1_000_003)
    rows = [tr.TraceRequest(0.25 * i, 8192, 256, [10**9 + 64 * i + b for b in range(16)])
            for i in range(n)]
    reqs = tr.build_requests(rows, scaling, blocks)
    # Up to 3 rounds until one is all ok: right after "ready" a request can still be routed
    # to a decode worker the frontend has not discovered yet (HTTP 502).
    for _ in range(3):
        res = tr.run_replay(url, cfg, label="warm-up", progress_s=0, deadline_s=120,
                            reqs=reqs, workload={})
        print(f"[warm-up] {res['summary']['outcomes']}", flush=True)
        if res["summary"]["outcomes"] == {"ok": n}:
            return
        time.sleep(1)


REQUEST_COLUMNS = ("index", "scheduled_s", "sent_s", "prompt_tokens", "max_tokens", "outcome",
                   "status", "ttft_s", "tpot_s", "e2e_s", "output_tokens", "error")


def compact(records: list[dict]) -> list[list]:
    """Per-request records as rows of ``REQUEST_COLUMNS`` (times rounded to 0.1 ms)."""
    def cell(v):
        return round(v, 4) if isinstance(v, float) else v
    return [[cell(r.get(c)) for c in REQUEST_COLUMNS] for r in records]


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def run_policy(name: str, args, cfg: tr.ReplayConfig, reqs, workload) -> dict:
    overrides = [*fleet_overrides(args), *POLICIES[name]]
    speed = cfg.rate_scale / cfg.time_scale  # x the trace's request rate
    name_at = f"{name} x{speed:g}"
    print(f"== {name_at}: starting {GRAPH} -f {CONFIG} {' '.join(overrides)}", flush=True)
    t0 = time.monotonic()
    with GraphRun(GRAPH, CONFIG, overrides, startup_timeout_s=args.startup_timeout) as g:
        print(f"[{name_at}] up in {g.startup_s:.1f}s at {g.url}", flush=True)
        policy = g.resolved_config("DecodeWorker").get("disaggregated_router")
        warm_up(g.url, cfg, args.warmup)
        before = g.metric_by_labels("DecodeWorker", DECISIONS, "where")
        before_r = g.metric_by_labels("DecodeWorker", DECISIONS, "reason")
        before_f = g.metric_by_labels("DecodeWorker", FALLBACKS, "reason")
        load0 = loadavg()
        res = tr.run_replay(g.url, cfg, label=name_at, progress_s=args.progress_s,
                            deadline_s=args.deadline_s, reqs=reqs, workload=workload)
        load1 = loadavg()
        time.sleep(0.5)  # let the last decisions' counters land
        after = g.metric_by_labels("DecodeWorker", DECISIONS, "where")
        after_r = g.metric_by_labels("DecodeWorker", DECISIONS, "reason")
        after_f = g.metric_by_labels("DecodeWorker", FALLBACKS, "reason")
    res.update(policy=name, time_scale=cfg.time_scale, rate_factor=speed,
               offered_rps=workload["offered_rps"], overrides=overrides, disaggregated_router=policy,
               decisions=diff(after, before), decision_reasons=diff(after_r, before_r),
               fallbacks=diff(after_f, before_f), loadavg_before=load0, loadavg_after=load1,
               wall_s=time.monotonic() - t0)
    tr.print_summary(res["summary"], name_at)
    print(f"[{name_at}] decisions {res['decisions']} reasons {res['decision_reasons']} "
          f"fallbacks {res['fallbacks']} | load {load0} -> {load1}", flush=True)
    return res


def table(results: list[dict]) -> str:
    slo = results[0]["summary"]["slo"] if results else {}
    slo_txt = ", ".join(f"{k[:-3].upper()} <= {v:g} ms" for k, v in slo.items())
    head = ("| rate | policy | ok / sent | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | E2E p50 | "
            f"E2E p99 | output tok/s | goodput ({slo_txt}) | remote / local decisions |")
    lines = [head, "|" + "---|" * 12]
    f = tr.fmt_ms
    for r in results:
        s = r["summary"]
        d = r["decisions"]
        lines.append(
            f"| x{r['rate_factor']:g} ({r['offered_rps']:.1f} req/s) | {r['policy']} | "
            f"{s['outcomes'].get('ok', 0)} / {s['requests']} | "
            f"{f(s['ttft_ms']['p50'])} ms | {f(s['ttft_ms']['p99'])} ms | "
            f"{f(s['tpot_ms']['p50'])} ms | {f(s['tpot_ms']['p99'])} ms | "
            f"{f(s['e2e_ms']['p50'])} ms | {f(s['e2e_ms']['p99'])} ms | "
            f"{s['output_token_throughput_tps']:.0f} | "
            f"{s['goodput_rps']:.2f} req/s ({s['slo_met']}/{s['requests']} met) | "
            f"{d.get('remote', 0):.0f} / {d.get('local', 0):.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tr.add_replay_args(p)
    p.set_defaults(duration_s=120.0, token_scale=16, output_scale=16.0,
                   slo="ttft=500,tpot=50")
    p.add_argument("--time-scales", type=float, nargs="+", default=[0.5, 0.25],
                   help="load points: each replays the window with arrival times x this "
                        "(0.5 = twice the trace's rate); overrides --time-scale")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES),
                   default=["score", "local", "remote"])
    p.add_argument("--speedup", type=float, default=1.0,
                   help="mocker speedup_ratio of every engine (1 = real time)")
    p.add_argument("--kv-bandwidth", type=float, default=10.0,
                   help="simulated KV transfer bandwidth of the prefill engines, GB/s")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests per graph")
    p.add_argument("--startup-timeout", type=float, default=240)
    p.add_argument("--deadline-s", type=float, default=300,
                   help="per policy: cancel requests still running this long after start")
    p.add_argument("--progress-s", type=float, default=10.0)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/offload_policy.json"))
    args = p.parse_args()

    t0 = time.monotonic()
    results, workloads = [], []
    for ts in args.time_scales:
        args.time_scale = ts
        cfg = tr.config_from_args(args)
        reqs, workload = tr.prepare(cfg)
        workload["time_scale"] = ts
        workloads.append(workload)
        print(f"{len(reqs)} requests from trace window [{args.start_s}, "
              f"{args.start_s + args.duration_s}) s, replayed over "
              f"{workload['replay_span_s']:.1f}s ({workload['offered_rps']:.2f} req/s); scaled "
              f"prompt tokens p50 {workload['prompt_tokens']['p50']:.0f} mean "
              f"{workload['prompt_tokens']['mean']:.0f}, max_tokens mean "
              f"{workload['max_tokens']['mean']:.0f}; {workload['clipped_requests']} clipped",
              flush=True)
        for name in args.policies:
            results.append(run_policy(name, args, cfg, reqs, workload))
    print()
    print(table(results))
    payload = {
        "benchmark": "offload_policy", "graph": GRAPH, "config": CONFIG,
        "command": "python " + " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "time_scale")},
        "fleet": {"prefill_workers": 2, "decode_workers": 2, "engine_type": "sglang",
                  "speedup_ratio": args.speedup, "kv_transfer_bandwidth_GBps": args.kv_bandwidth},
        "scaling": {"token_scale": cfg.token_scale, "output_scale": cfg.output_scale,
                    "block_tokens": tr.TRACE_BLOCK_TOKENS // cfg.token_scale,
                    "context": cfg.context, "time_scales": args.time_scales,
                    "rate_scale": cfg.rate_scale},
        "workloads": workloads, "machine": machine(), "versions": versions(),
        "total_wall_s": time.monotonic() - t0,
        "table_md": table(results),
        "request_columns": list(REQUEST_COLUMNS),
        "results": [{k: v for k, v in r.items() if k not in ("requests", "workload")}
                    | {"requests": compact(r["requests"])} for r in results],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out} (total {payload['total_wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
