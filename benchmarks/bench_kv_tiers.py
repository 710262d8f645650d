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
greedy, ``--answer`` tokens.  The same requests run on fresh graphs
(``graphs.agg_router:Frontend``, one torch worker), one per mode: ``off`` (no tiers),
``host`` (a host tier) and ``disk`` (a disk tier alone, in a temporary directory).

Per mode: TTFT p50 / p99 of returning turns and of first turns; the prompt tokens the
engine did not compute (``usage.prompt_tokens_details.cached_tokens``); the worker's
host-tier hits, restored blocks, bytes read back and their read time
(``splitserve_worker_kv_tier_*``); and the router's own prediction, the prefix blocks it
credited the chosen worker with per tier (``splitserve_router_tier_hit_blocks_total``),
beside the engine's actual hits per tier (host: the tier's hits; device: cached blocks
less the restored ones); admission's TTFT prediction for each returning turn (the
``x-splitserve-predicted-ttft-ms`` header) against its measured TTFT: a lower-tier hit
is priced at the restore cost the worker measured.  Greedy answers of every mode are
compared with ``off``'s (restored KV must give what a recompute gives).

    python benchmarks/bench_kv_tiers.py --out benchmarks/results/kv_tiers.json

``--trace FILE`` replays the Mooncake conversation trace instead (its prefixes repeat as
conversations return).  On these CPUs the trace cannot be replayed whole or in real
time, so the benchmark keeps its prefix structure and order and drops the rest: a
conversation is the rows of the first ``--trace-window-s`` seconds that share their two
leading 512-token blocks (at least two such rows); it keeps the first
``--conversations`` conversations (by their first row) with all their rows, in arrival
order.  Each trace block
becomes ``512 / --token-scale`` tokens of ids drawn from its hash id (equal ids, equal
tokens), prompts are cut at ``--max-prompt`` tokens and sent as token ids to
``/v1/completions``, one at a time, ``--answer`` tokens each.  A row is *returning* when
an earlier kept row shares at least two leading blocks with it.

    python benchmarks/bench_kv_tiers.py --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \
        --num-blocks 256 --host-gib 1 --disk-gib 1 --out benchmarks/results/kv_tiers_mooncake.json

``--frontends splitserve dynamo`` runs every mode twice over the same torch workers
(``--workers`` of them): behind this project's frontend and Router, and behind Dynamo's
frontend in kv mode (the workers register a Dynamo model card,
``Worker.dynamo_model_card``).  Dynamo's router reads the workers' pool events but no
tier's (its Python publisher has none), so with more than one worker it places a
returning conversation without knowing which worker keeps its prefix in a lower tier;
its side reports no router prediction and no admission prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare.py: Dynamo's side

from splitserve.bench.graphrun import GraphRun  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PREDICTED_TTFT_HEADER = "x-splitserve-predicted-ttft-ms"  # admission's prediction
MODES = ("off", "host", "disk")
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
    return _streamed(f"{url}/v1/chat/completions", {"messages": messages}, answer,
                     lambda choice: (choice.get("delta") or {}).get("content"))


def ask_ids(url: str, prompt: list[int], answer: int) -> dict:
    """One streamed greedy completion of token ids: TTFT, the answer and the usage."""
    return _streamed(f"{url}/v1/completions", {"prompt": prompt}, answer,
                     lambda choice: choice.get("text"))


def _streamed(endpoint: str, fields: dict, answer: int, piece_of) -> dict:
    import urllib.request

    body = json.dumps({"model": MODEL, **fields, "max_tokens": answer, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(endpoint, data=body,
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        predicted = r.headers.get(PREDICTED_TTFT_HEADER)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = piece_of(choice)
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": ttft, "answer": "".join(text), "cached_tokens": cached,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "predicted_ttft_s": float(predicted) / 1000.0 if predicted else None}


def trace_requests(args) -> list[dict]:
    """The kept rows of the Mooncake trace (see the module docstring), in arrival order:
    ``prompt`` (token ids), ``returning`` and the row's index in the trace."""
    from splitserve.bench.replay import BlockTokens, TokenScaling, load_mooncake

    rows = [r for r in load_mooncake(args.trace) if r.t_s <= args.trace_window_s]
    prefixes: dict[tuple[int, ...], int] = {}  # a 2-block prefix -> rows starting with it
    for r in rows:
        key = tuple((r.hash_ids or [])[:2])
        if len(key) == 2:
            prefixes[key] = prefixes.get(key, 0) + 1
    scaling = TokenScaling(token_scale=args.token_scale, context=args.max_prompt + args.answer)
    blocks = BlockTokens(scaling.block_tokens, seed=args.seed)
    kept, seen = [], set()
    for i, r in enumerate(rows):
        key = tuple((r.hash_ids or [])[:2])
        if len(key) < 2 or prefixes[key] < 2:
            continue
        if key not in seen and len(seen) >= args.conversations:
            continue
        plen, _, _ = scaling.lengths(r.input_length, args.answer)
        plen = min(plen, args.max_prompt)
        kept.append({"trace_row": i, "prompt": blocks.prompt(list(r.hash_ids), plen),
                     "returning": key in seen})
        seen.add(key)
    return kept


def play_trace(url: str, args, mode: str) -> list[dict]:
    rows = []
    for n, req in enumerate(trace_requests(args)):
        r = ask_ids(url, req["prompt"], args.answer)
        rows.append({"trace_row": req["trace_row"], "turn": int(req["returning"]), **r})
        print(f"[{mode}] request {n} (trace row {req['trace_row']}, "
              f"{'returning' if req['returning'] else 'first'}): ttft {r['ttft_s']:.3f} s, "
              f"prompt {r['prompt_tokens']}, cached {r['cached_tokens']}", flush=True)
    return rows


def play_sessions(url: str, args, mode: str) -> list[dict]:
    rng = random.Random(args.seed)
    history: list[list[dict]] = [[] for _ in range(args.sessions)]
    rows = []
    for turn in range(args.turns):
        for s in range(args.sessions):
            history[s].append({"role": "user", "content": question(rng, args.words, s, turn)})
            r = ask(url, history[s], args.answer)
            history[s].append({"role": "assistant", "content": r["answer"]})
            rows.append({"session": s, "turn": turn, **r})
            print(f"[{mode}] session {s} turn {turn}: ttft {r['ttft_s']:.3f} s, "
                  f"prompt {r['prompt_tokens']}, cached {r['cached_tokens']}", flush=True)
    return rows


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_mode(mode: str, args, frontend: str = "splitserve") -> dict:
    overrides = [f"--Worker.replicas={args.workers}",
                 f"--Worker.engine_args.num_blocks={args.num_blocks}"]
    if args.threads:
        overrides.append(f"--Worker.engine_args.threads={args.threads}")
    if mode == "host":
        overrides.append(f"--Worker.engine_args.host_kv_cache_gib={args.host_gib}")
    if mode == "disk":
        disk_dir = tempfile.mkdtemp(prefix="kv-tiers-bench-")
        overrides += [f"--Worker.engine_args.disk_kv_cache_dir={disk_dir}",
                      f"--Worker.engine_args.disk_kv_cache_gib={args.disk_gib}"]
    if frontend == "dynamo":
        return run_dynamo_mode(mode, args, overrides)
    with GraphRun("graphs.agg_router:Frontend", "configs/agg_router.yaml", overrides,
                  startup_timeout_s=300) as g:
        ask(g.url, [{"role": "user", "content": "Hello."}], 2)  # first-use costs out
        rows = (play_trace if args.trace else play_sessions)(g.url, args, mode)
        time.sleep(1.0)  # the last tier events reach the router

        engine = engine_counters(g)
        router = g.metric_by_labels("Router", "splitserve_router_tier_hit_blocks_total", "tier")
    return summary(mode, "splitserve", rows, engine, router)


def engine_counters(g) -> dict:
    """The workers' tier counters, summed over the replicas."""

    def worker(name: str, **labels: str) -> float:
        return g.metric_total("Worker", name, **labels)

    return {
        "host_hit_blocks": worker("splitserve_worker_kv_tier_hits_total", tier="host"),
        "disk_hit_blocks": worker("splitserve_worker_kv_tier_hits_total", tier="disk"),
        "restored_blocks": worker("splitserve_worker_kv_tier_moved_blocks_total",
                                  direction="restored"),
        "offloaded_blocks": worker("splitserve_worker_kv_tier_moved_blocks_total",
                                   direction="offloaded"),
        "host_read_bytes": worker("splitserve_worker_kv_tier_read_bytes_total", tier="host"),
        "host_read_s": worker("splitserve_worker_kv_tier_read_seconds_sum", tier="host"),
        "host_write_s": worker("splitserve_worker_kv_tier_write_seconds_sum", tier="host"),
        "disk_read_bytes": worker("splitserve_worker_kv_tier_read_bytes_total", tier="disk"),
        "disk_read_s": worker("splitserve_worker_kv_tier_read_seconds_sum", tier="disk"),
        "disk_write_s": worker("splitserve_worker_kv_tier_write_seconds_sum", tier="disk"),
    }


def run_dynamo_mode(mode: str, args, overrides: list[str]) -> dict:
    """The same workers (this project's torch workers, tiers as ``mode`` says) behind
    Dynamo's frontend in kv mode: they register a Dynamo model card
    (``Worker.dynamo_model_card``), its router reads their pool's KV events (Dynamo's
    publisher) and, having no tier in them, none of their tiers'."""
    from compare import WorkersRun, dynamo_frontend

    with WorkersRun("graphs.agg_router:Worker", "configs/agg_router.yaml",
                    [*overrides, "--Worker.dynamo_model_card=true"],
                    startup_timeout_s=300) as w:
        fe, url = dynamo_frontend(w, "kv", log_name=f"frontend-kv-{mode}.log")
        try:
            wait_for_models(url, fe)
            ask(url, [{"role": "user", "content": "Hello."}], 2)  # first-use costs out
            rows = (play_trace if args.trace else play_sessions)(url, args, f"dynamo {mode}")
            time.sleep(1.0)
            engine = engine_counters(w)
        finally:
            fe.stop()
    return summary(mode, "dynamo", rows, engine, None)


def wait_for_models(url: str, fe, timeout_s: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not fe.alive():
            raise RuntimeError(f"Dynamo's frontend exited:\n{fe.tail()}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if json.loads(r.read()).get("data"):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"Dynamo's frontend listed no model within {timeout_s:.0f}s")


def summary(mode: str, frontend: str, rows: list[dict], engine: dict,
            router: dict | None) -> dict:
    returning = [r for r in rows if r["turn"] > 0]
    first = [r for r in rows if r["turn"] == 0]
    cached_blocks = sum(r["cached_tokens"] for r in returning) // BLOCK
    prompt_blocks = sum((r["prompt_tokens"] or 0) for r in returning) // BLOCK
    lower = engine["host_hit_blocks"] + engine["disk_hit_blocks"]
    actual = {"host": engine["host_hit_blocks"], "disk": engine["disk_hit_blocks"],
              "device": max(0.0, cached_blocks - lower)}
    judged = [r for r in returning if r["predicted_ttft_s"] and r["ttft_s"]]
    return {
        "mode": mode,
        "frontend": frontend,
        "returning_ttft_p50_s": pct([r["ttft_s"] for r in returning], 0.5),
        "returning_ttft_p99_s": pct([r["ttft_s"] for r in returning], 0.99),
        "first_ttft_p50_s": pct([r["ttft_s"] for r in first], 0.5),
        "returning_prompt_blocks": prompt_blocks,
        "returning_cached_blocks": cached_blocks,
        "engine": engine,
        "engine_hit_rate": {t: n / prompt_blocks if prompt_blocks else None
                            for t, n in actual.items()},
        "router_hit_blocks": router,
        "router_hit_rate": None if router is None else {
            t: router.get(t, 0.0) / prompt_blocks if prompt_blocks else None
            for t in ("device", "host", "disk")},
        # Admission's TTFT prediction for returning turns against their measured TTFT
        # (a lower-tier hit priced at the restore cost the worker measured).
        "returning_predicted_ttft_p50_s": pct([r["predicted_ttft_s"] for r in judged], 0.5),
        "returning_measured_over_predicted_p50": pct(
            [r["ttft_s"] / r["predicted_ttft_s"] for r in judged], 0.5),
        "returning_measured_over_predicted_range": [
            min((r["ttft_s"] / r["predicted_ttft_s"] for r in judged), default=None),
            max((r["ttft_s"] / r["predicted_ttft_s"] for r in judged), default=None)],
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
    p.add_argument("--disk-gib", type=float, default=0.5, help="the disk tier of the "
                   "`disk` mode (no host tier there), in a fresh temporary directory")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--frontends", nargs="+", default=["splitserve"],
                   choices=["splitserve", "dynamo"], help="whose frontend and router in "
                   "front of the same torch workers: this project's, and/or Dynamo's in kv "
                   "mode (the workers then register a Dynamo model card)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: "
                   "the cores shared out; requests here come one at a time, so each worker "
                   "may take every core)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--trace", default=None, help="a Mooncake JSONL trace to replay instead "
                   "of the sessions (see above)")
    p.add_argument("--trace-window-s", type=float, default=900.0)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--token-scale", type=int, default=32,
                   help="a 512-token trace block becomes 512 / this many tokens")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report = {"command": "python benchmarks/bench_kv_tiers.py " + " ".join(argv or sys.argv[1:]),
              "args": vars(args), "cpus": os.cpu_count(), "modes": []}
    for frontend in args.frontends:
        for mode in args.modes:
            report["modes"].append(run_mode(mode, args, frontend))
    by_mode = {(m["frontend"], m["mode"]): m for m in report["modes"]}
    for m in report["modes"]:
        off = by_mode.get((m["frontend"], "off"))
        if off is None or m is off:
            continue
        tag = m["mode"] if m["frontend"] == "splitserve" else f"{m['mode']}_dynamo"
        same = [a["answer"] == b["answer"] for a, b in zip(off["requests"], m["requests"],
                                                            strict=True)]
        report[f"answers_equal_{tag}"] = f"{sum(same)} of {len(same)}"
        if off["returning_ttft_p50_s"] and m["returning_ttft_p50_s"]:
            report[f"returning_ttft_p50_ratio_{tag}"] = (
                off["returning_ttft_p50_s"] / m["returning_ttft_p50_s"])
    for m in report["modes"]:
        print(json.dumps({k: v for k, v in m.items() if k != "requests"}), flush=True)
    print(json.dumps({k: v for k, v in report.items()
                      if k.startswith(("answers_equal", "returning_ttft_p50_ratio"))}),
          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
