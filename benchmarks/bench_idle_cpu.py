"""What an idle graph costs: CPU of each of its processes while nothing is asked of it.

    python benchmarks/bench_idle_cpu.py [--graph graphs.agg:Frontend] [--config
        configs/agg.yaml] [--seconds 30] [--rounds 2] [--out FILE]

Each round starts the graph, answers one chat request (so every lazy path has run), waits
10 s, then reads each process's user + system CPU from /proc over ``--seconds`` and prints
CPU-ms per second by kind of process (supervisor, etcd, nats and each component's
replicas), then stops the graph.  Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from splitserve.bench.graphrun import GraphRun, descendants  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def kinds(run: GraphRun) -> dict[int, str]:
    """Each process of the graph by what it is."""
    named = {run.serve.proc.pid: "supervisor"}
    infra = json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())
    named.update({pid: name for name, pid in infra["pids"].items()})
    for rep in run.status()["replicas"]:
        if rep.get("pid"):
            named[rep["pid"]] = rep["component"].lower()
            for child in descendants(rep["pid"]):
                named.setdefault(child, rep["component"].lower())
    return named


def one_round(args: argparse.Namespace) -> dict[str, float]:
    with GraphRun(args.graph, args.config, args.overrides) as run:
        model = httpx.get(f"{run.url}/v1/models", timeout=30).json()["data"][0]["id"]
        httpx.post(f"{run.url}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()
        time.sleep(10)
        named = kinds(run)
        before = {pid: cpu_s(pid) for pid in named}
        time.sleep(args.seconds)
        after = {pid: cpu_s(pid) for pid in named}
    out: dict[str, float] = {}
    for pid, kind in named.items():
        if before[pid] is not None and after[pid] is not None:
            out[kind] = out.get(kind, 0.0) + (after[pid] - before[pid]) * 1000 / args.seconds
    out = {k: round(v, 1) for k, v in sorted(out.items())}
    out["total"] = round(sum(out.values()), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--graph", default="graphs.agg:Frontend")
    p.add_argument("--config", default="configs/agg.yaml")
    p.add_argument("--overrides", nargs="*", default=[])
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    rounds = []
    for i in range(args.rounds):
        r = one_round(args)
        print(f"round {i}: CPU-ms per second {json.dumps(r)}", flush=True)
        rounds.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/bench_idle_cpu.py " + " ".join(sys.argv[1:]),
            "rounds": rounds}, indent=1) + "\n")


if __name__ == "__main__":
    main()
