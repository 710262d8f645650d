"""Aggregated against disaggregated vLLM (the CPU build) through the served graph.

One request at a time, streamed completions with the official ``openai`` client: the
same 12-token prompt three times (runs 1 and 2 hit the prefix cache), ``max_tokens`` 64
with ``ignore_eos``, greedy; the time to the first text chunk and the decode rate of the
chunks after it.  Then a number of sequential chat requests of 8 tokens (the e2e test's
prompts) through the disaggregated graph with remote prefill forced, and two more after
``--idle-s`` seconds idle: their latencies, and how many KV leases vLLM's prefill engine
let expire (its log's "Releasing expired KV blocks").  Last, how long the graph took to stop
after SIGTERM and whether vLLM had to force-kill an engine process on the way.

    python benchmarks/bench_vllm_disagg.py [--sequential 20] [--idle-s 70]

Prints a table and writes benchmarks/results/vllm_disagg.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splitserve.bench.graphrun import GraphRun  # noqa: E402
from tests.e2e.prompts import FORCED, MODEL, PROMPTS  # noqa: E402

PROMPT = "Count from 1 to 100, separated by commas."
GRAPHS = {
    "aggregated": ("graphs.agg:Frontend", "configs/vllm_agg.yaml", []),
    "disaggregated": ("graphs.disagg:Frontend", "configs/vllm_disagg.yaml",
                      [FORCED, "--Frontend.inter_token_timeout_s=150"]),
}


def stream_once(c: openai.OpenAI) -> tuple[float, float]:
    """TTFT in s and decode tokens/s after the first chunk."""
    t0 = time.monotonic()
    first = None
    n = 0
    for chunk in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.monotonic()
            else:
                n += 1
    end = time.monotonic()
    return first - t0, n / max(end - first, 1e-9)


def timed_chat(c: openai.OpenAI, prompt: str) -> float | str:
    t0 = time.monotonic()
    try:
        c.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                  messages=[{"role": "user", "content": prompt}])
    except openai.APIError as exc:
        return f"error: {type(exc).__name__}"
    return round(time.monotonic() - t0, 2)


def run_graph(name: str, sequential: int, idle_s: float) -> dict:
    graph, config, overrides = GRAPHS[name]
    run = GraphRun(graph, config, overrides, startup_timeout_s=600, stop_timeout_s=120,
                   log_level="info", keep_dir=True).start()
    try:
        out: dict = {"startup_s": round(run.startup_s, 1)}
        with openai.OpenAI(base_url=f"{run.url}/v1", api_key="unused", max_retries=0,
                           timeout=180) as c:
            runs = [stream_once(c) for _ in range(3)]
            out["ttft_s"] = [round(t, 2) for t, _ in runs]
            out["decode_tok_s"] = [round(r, 1) for _, r in runs]
            if name == "disaggregated":
                out["sequential_s"] = [timed_chat(c, p) for p in PROMPTS[:sequential]]
                time.sleep(idle_s)
                out["after_idle_s"] = [timed_chat(c, p) for p in PROMPTS[:2]]
    finally:
        serve = run.serve
        t0 = time.monotonic()
        code = run.stop()
    out["stop_s"] = round(time.monotonic() - t0, 1)
    out["stop_exit_code"] = code
    log = serve.output() if serve is not None else ""
    shutil.rmtree(run.tmp, ignore_errors=True)  # kept only to read the log after the stop
    out["expired_leases"] = len(re.findall("Releasing expired KV blocks", log))
    out["engine_force_killed"] = len(re.findall("force killing", log, re.IGNORECASE))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequential", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=70)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/vllm_disagg.json"))
    a = ap.parse_args()
    results = {name: run_graph(name, a.sequential, a.idle_s) for name in GRAPHS}
    print(f"{'graph':<15} {'TTFT run 0/1/2 (s)':<22} {'decode tok/s 0/1/2':<22}")
    for name, r in results.items():
        print(f"{name:<15} {' / '.join(map(str, r['ttft_s'])):<22} "
              f"{' / '.join(map(str, r['decode_tok_s'])):<22}")
    d = results["disaggregated"]
    print("sequential chat requests (s):", d["sequential_s"])
    print(f"after {a.idle_s:.0f} s idle (s):", d["after_idle_s"],
          "expired KV leases:", d["expired_leases"])
    for name, r in results.items():
        print(f"{name}: stopped in {r['stop_s']} s (exit code {r['stop_exit_code']}), "
              f"engine processes force-killed: {r['engine_force_killed']}")
    Path(a.out).write_text(json.dumps({
        "command": "python benchmarks/bench_vllm_disagg.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": len(os.sched_getaffinity(0)),
                    "python": platform.python_version()},
        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
