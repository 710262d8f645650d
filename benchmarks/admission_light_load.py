"""Admission at one load point: how many requests the router rejected, and why.

The goodput sweep (``compare.py --loads``) records only that a request was rejected;
this runs ``compare.py``'s ``splitserve-admission`` configuration (same graph, same
warm-up, same trace scaling and plan) at a single load and adds the router's own count of
verdicts by reason (``splitserve_qos_admissions_total``), so a light-load run shows
whether the estimate or the queue turned requests away::

    python benchmarks/admission_light_load.py --load 0.5 --window-s 10

Prints one JSON object (the replay summary, outcomes and the verdicts by reason); with
``--out`` it is also written there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # the benchmarks directory is on sys.path, not a package
import sweep_plan as sp
from splitserve.bench.graphrun import GraphRun, scrape

from splitserve.bench import replay as rp


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", type=float, default=0.5, help="multiple of --capacity-rps")
    p.add_argument("--capacity-rps", type=float, default=40.0)
    p.add_argument("--window-s", type=float, default=10.0, help="wall seconds of arrivals")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--drain-s", type=float, default=20.0)
    p.add_argument("--admission-ttft-ms", type=float, default=1000.0)
    p.add_argument("--admission-queue-per-worker", type=int, default=8)
    p.add_argument("--slo", default="ttft=1000,tpot=50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.load <= 0 or args.window_s <= 0:
        raise SystemExit(f"--load and --window-s must be > 0, got {args.load}, {args.window_s}")

    rows = rp.load_trace(rp.resolve_trace(rp.DEFAULT_TRACE))
    (point,) = sp.plan_loads([r.t_s for r in rows], args.capacity_rps, [args.load],
                             args.window_s, args.window_s, sustained_from=float("inf"))
    cfg = rp.ReplayConfig(trace=rp.DEFAULT_TRACE, duration_s=point.duration_trace_s,
                          token_scale=4, output_scale=16.0, seed=args.seed,
                          slo=rp.parse_slo(args.slo), timeout_s=60.0, model=compare.MODEL)
    cfg = replace(cfg, rate_scale=round(point.rate_scale, 3))  # as compare.py rounds it
    reqs, workload = rp.prepare(cfg)
    overrides = [f"--Worker.replicas={args.workers}", "--Worker.engine_args.speedup_ratio=1.0",
                 *compare.admission_overrides(args)]
    t0 = time.monotonic()
    with GraphRun("graphs.agg_router:Frontend", "configs/mocker_agg_router.yaml",
                  overrides) as g:
        warmup = compare.wait_serving(g.url, 60, 2 * args.workers)
        res = rp.run_replay(g.url, cfg, label=f"x{args.load:g}", progress_s=5.0,
                            deadline_s=workload["replay_span_s"] + args.drain_s,
                            reqs=reqs, workload=workload)
        verdicts: dict[str, float] = {}
        for rep in g.replicas("Router"):
            if not rep.get("metrics"):
                continue
            for labels, value in scrape(rep["metrics"]).get(
                    "splitserve_qos_admissions_total", {}).items():
                d = dict(labels)
                key = f"{d.get('outcome')}/{d.get('reason')}"
                verdicts[key] = verdicts.get(key, 0.0) + value
    summary = res["summary"]
    out = {"command": "python benchmarks/admission_light_load.py "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "load_x_capacity": args.load, "offered_rps": workload["offered_rps"],
           "requests": summary["requests"], "outcomes": summary["outcomes"],
           "goodput_rps": summary["goodput_rps"], "slo_attainment": summary["slo_attainment"],
           "ttft_ms": {k: summary["ttft_ms"][k] for k in ("p50", "p90", "p99")},
           "tpot_ms": {k: summary["tpot_ms"][k] for k in ("p50", "p99")},
           "warmup_requests": warmup,
           "router_verdicts_incl_warmup": verdicts, "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
