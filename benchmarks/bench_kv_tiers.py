"""Returning conversations whose working set is larger than the engine's KV pool: the
torch engine's host tier against recompute, and the router's view of the tiers against
what the engine actually read.

An agent-session trace: ``--sessions`` conversations take turns (session 1 turn 1,
session 2 turn 1, ..., session 1 turn 2, ...); every turn re-sends the whole history
(its earlier questions and the model's own answers) plus a new question of
``--words`` words, so between two turns of one session every other session passes
through the pool.  The pool (``--num-blocks``) holds about one session: with tiers off
a returning turn recomputes its history, with a host tier of ``--host-gib`` it restores
it.  One request at a time (TTFT is then the engine's own work, not a queue), streamed,
greedy, ``--answer`` tokens.  The same requests run on two fresh graphs
(``graphs.agg_router:Frontend``, one torch worker): ``off`` and ``host``.

Per mode: TTFT p50 / p99 of returning turns and of first turns; the prompt tokens the
engine did not compute (``usage.prompt_tokens_details.cached_tokens``); the worker's
host-tier hits, restored blocks, bytes read back and their read time
(``splitserve_worker_kv_tier_*``); and the router's own prediction, the prefix blocks it
credited the chosen worker with per tier (``splitserve_router_tier_hit_blocks_total``),
beside the engine's actual hits per tier (host: the tier's hits; device: cached blocks
less the restored ones).  Greedy answers of both modes are compared (restored KV must
give what a recompute gives).

    python benchmarks/bench_kv_tiers.py --out benchmarks/results/kv_tiers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.bench.graphrun import GraphRun  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the torch engine's block size in configs/agg_router.yaml
VOCAB = ("river stone cloud maple tiger ocean piano amber delta ember frost harbor lantern "
         "meadow canyon violet copper willow falcon garden marble thunder compass orchard "
         "summit glacier beacon saddle timber quartz velvet cobalt prairie lagoon ember "
         "cedar walnut pepper saffron").split()


def question(rng: random.Random, words: int, session: int, turn: int) -> str:
    body = " ".join(rng.choice(VOCAB) for _ in range(words))
    return f"Session {session}, note {turn}: {body}. Summarise it in one line."


def ask(url: str, messages: list[dict], answer: int) -> dict:
    """One streamed greedy chat request: TTFT, the answer and the usage."""
    import urllib.request

    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": answer,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": ttft, "answer": "".join(text), "cached_tokens": cached,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_mode(mode: str, args) -> dict:
    overrides = ["--Worker.replicas=1", f"--Worker.engine_args.num_blocks={args.num_blocks}"]
    if mode == "host":
        overrides.append(f"--Worker.engine_args.host_kv_cache_gib={args.host_gib}")
    rng = random.Random(args.seed)
    history: list[list[dict]] = [[] for _ in range(args.sessions)]
    rows = []
    with GraphRun("graphs.agg_router:Frontend", "configs/agg_router.yaml", overrides,
                  startup_timeout_s=300) as g:
        ask(g.url, [{"role": "user", "content": "Hello."}], 2)  # first-use costs out
        for turn in range(args.turns):
            for s in range(args.sessions):
                history[s].append({"role": "user",
                                   "content": question(rng, args.words, s, turn)})
                r = ask(g.url, history[s], args.answer)
                history[s].append({"role": "assistant", "content": r["answer"]})
                rows.append({"session": s, "turn": turn, **r})
                print(f"[{mode}] session {s} turn {turn}: ttft {r['ttft_s']:.3f} s, "
                      f"prompt {r['prompt_tokens']}, cached {r['cached_tokens']}", flush=True)
        time.sleep(1.0)  # the last tier events reach the router

        def worker(name: str, **labels: str) -> float:
            return g.metric_total("Worker", name, **labels)

        engine = {
            "host_hit_blocks": worker("splitserve_worker_kv_tier_hits_total", tier="host"),
            "restored_blocks": worker("splitserve_worker_kv_tier_moved_blocks_total",
                                      direction="restored"),
            "offloaded_blocks": worker("splitserve_worker_kv_tier_moved_blocks_total",
                                       direction="offloaded"),
            "host_read_bytes": worker("splitserve_worker_kv_tier_read_bytes_total",
                                      tier="host"),
            "host_read_s": worker("splitserve_worker_kv_tier_read_seconds_sum", tier="host"),
            "host_write_s": worker("splitserve_worker_kv_tier_write_seconds_sum", tier="host"),
        }
        router = g.metric_by_labels("Router", "splitserve_router_tier_hit_blocks_total", "tier")
    returning = [r for r in rows if r["turn"] > 0]
    first = [r for r in rows if r["turn"] == 0]
    cached_blocks = sum(r["cached_tokens"] for r in returning) // BLOCK
    prompt_blocks = sum((r["prompt_tokens"] or 0) for r in returning) // BLOCK
    actual = {"host": engine["host_hit_blocks"],
              "device": max(0.0, cached_blocks - engine["host_hit_blocks"])}
    return {
        "mode": mode,
        "returning_ttft_p50_s": pct([r["ttft_s"] for r in returning], 0.5),
        "returning_ttft_p99_s": pct([r["ttft_s"] for r in returning], 0.99),
        "first_ttft_p50_s": pct([r["ttft_s"] for r in first], 0.5),
        "returning_prompt_blocks": prompt_blocks,
        "returning_cached_blocks": cached_blocks,
        "engine": engine,
        "engine_hit_rate": {t: n / prompt_blocks if prompt_blocks else None
                            for t, n in actual.items()},
        "router_hit_blocks": router,
        "router_hit_rate": {t: router.get(t, 0.0) / prompt_blocks if prompt_blocks else None
                            for t in ("device", "host")},
        "requests": rows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--words", type=int, default=120, help="words per new question")
    p.add_argument("--answer", type=int, default=8, help="output tokens per turn")
    p.add_argument("--num-blocks", type=int, default=64,
                   help="the device pool, in 16-token blocks")
    p.add_argument("--host-gib", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report = {"command": "python benchmarks/bench_kv_tiers.py " + " ".join(argv or sys.argv[1:]),
              "args": vars(args), "cpus": os.cpu_count(), "modes": []}
    for mode in ("off", "host"):
        report["modes"].append(run_mode(mode, args))
    off, host = report["modes"]
    same = [a["answer"] == b["answer"] for a, b in zip(off["requests"], host["requests"],
                                                        strict=True)]
    report["answers_equal"] = f"{sum(same)} of {len(same)}"
    if off["returning_ttft_p50_s"] and host["returning_ttft_p50_s"]:
        report["returning_ttft_p50_ratio"] = (off["returning_ttft_p50_s"]
                                              / host["returning_ttft_p50_s"])
    for m in report["modes"]:
        print(json.dumps({k: v for k, v in m.items() if k != "requests"}), flush=True)
    print(json.dumps({k: report[k] for k in ("answers_equal", "returning_ttft_p50_ratio")
                      if k in report}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
