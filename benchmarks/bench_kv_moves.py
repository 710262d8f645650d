"""Time to resume a moved request: live KV move over NIXL against recomputing.

Two torch engines (the real SmolLM2 model on CPU, one at work at a time) with real NIXL agents
(UCX over DRAM, etcd started here for their directory), in one process.  For contexts of
1k, 4k and 8k tokens a request runs on engine A until it has produced 8 tokens and is
parked there, as a drain does.  Then it continues on engine B, two ways:

- **move**: B reserves blocks for the tokens so far, A writes its KV into them over
  NIXL (``export_parked``), B resumes after the last token (``resume_moved``);
- **recompute**: B prefills the prompt and the 8 tokens itself (what a resume without the
  KV does), here as many tokens that B's prefix cache does not hold (the cost depends
  on the count only).

The time to resume runs from asking B to continue until B's first new token.  The moved
continuation is checked token for token against the request run uninterrupted on A.

    python benchmarks/bench_kv_moves.py [--out benchmarks/results/kv_moves.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splitserve.contracts.engine import GenerateParams  # noqa: E402
from splitserve.components.engines.torch_cpu import (  # noqa: E402
    EngineConfig,
    EngineCore,
    load_model,
)
from splitserve.components.engines.torch_cpu.adapter import TorchEngine  # noqa: E402
from splitserve.components.engines.torch_cpu.runner import EngineRunner  # noqa: E402
from splitserve.components.engines.torch_cpu.kv_transfer import KvTransferAgent, KvTransferConfig  # noqa: E402
from splitserve.infra.embedded import EmbeddedInfra  # noqa: E402

CONTEXTS = (1024, 4096, 8000)  # SmolLM2 holds 8,192 positions: 8,000 leaves room to decode
BLOCK = 16
BEFORE = 8   # tokens produced on A before the park
AFTER = 16   # tokens the continuation produces on B


def prompt(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, vocab - 100) for _ in range(n))


def params(token_ids, max_tokens: int) -> GenerateParams:
    return GenerateParams(token_ids=tuple(token_ids), max_tokens=max_tokens,
                          temperature=0.0)


async def first_then_rest(stream) -> tuple[float, list[int]]:
    """Seconds until the first delta with a token, and every token."""
    t0 = time.perf_counter()
    first, tokens = None, []
    async for d in stream:
        if d.token_ids and first is None:
            first = time.perf_counter() - t0
        tokens += d.token_ids
    return first, tokens


async def park_after(engine: TorchEngine, rid: str, token_ids) -> tuple[int, ...]:
    stream = engine.generate(rid, params(token_ids, BEFORE + AFTER))
    got = 0
    async for d in stream:
        got += len(d.token_ids)
        if got >= BEFORE:
            break
    _, tokens = await engine.park(rid)
    await stream.aclose()
    return tokens


def exporter(source: TorchEngine, rid: str, writes: list):
    """The fetch of a move: ``source`` writes ``rid``'s parked KV (its WriteResult kept)."""
    async def fetch(handoff, notify_id) -> None:
        writes.append(await source.export_parked(rid, handoff, notify_id))
    return fetch


async def main(repeats: int) -> dict:
    model = load_model()
    vocab = model.config.vocab_size
    blocks = (max(CONTEXTS) + BEFORE + AFTER) // BLOCK + 8
    with tempfile.TemporaryDirectory() as tmp, EmbeddedInfra(Path(tmp)) as infra:
        cfg = KvTransferConfig(namespace="bench-kv-moves", timeout_s=60)
        engines = {}
        for name in ("a", "b"):
            core = EngineCore(model.weights, model.config, EngineConfig(
                block_size=BLOCK, num_blocks=blocks * 2))
            runner = EngineRunner(core, asyncio.get_running_loop())
            runner.start()
            agent = KvTransferAgent(f"bench-{name}", core.kv_pool(),
                                    etcd_endpoints=infra.etcd, config=cfg)
            await agent.start()
            agent.start_poller()
            engines[name] = TorchEngine(core, runner, BLOCK, agent, arrival_timeout_s=60,
                                        park_hold_s=600)
        a, b = engines["a"], engines["b"]
        rows = []
        try:
            for n in CONTEXTS:
                for rep in range(repeats):
                    p = prompt(n, 1000 * n + rep, vocab)
                    _, whole = await first_then_rest(a.generate(f"ref-{n}-{rep}",
                                                                params(p, BEFORE + AFTER)))
                    # move
                    tokens = await park_after(a, f"mv-{n}-{rep}", p)
                    writes: list = []
                    fetch = exporter(a, f"mv-{n}-{rep}", writes)
                    outcome: list[str] = []
                    made = list(tokens[len(p):])  # 8, or more when a step ended meanwhile
                    left = BEFORE + AFTER - len(made)
                    t_move, cont = await first_then_rest(b.resume_moved(
                        f"mv-{n}-{rep}", params(tokens, left), fetch, outcome.append))
                    # recompute: the same number of tokens, which B has not cached (its
                    # cost depends on the count only)
                    tokens2 = prompt(n, 7 + 1000 * n + rep, vocab) + tuple(made)
                    t_rec, _ = await first_then_rest(b.generate(f"rc-{n}-{rep}",
                                                                params(tokens2, left)))
                    w = writes[0]
                    row = {"prompt_tokens": n, "context_tokens": len(tokens) - 1,
                           "repeat": rep,
                           "outcome": outcome[0], "move_s": round(t_move, 4),
                           "recompute_s": round(t_rec, 4),
                           "speedup": round(t_rec / t_move, 1),
                           "nixl_write_s": round(w.seconds, 4), "bytes": w.nbytes,
                           "path": w.path,
                           "continuation_equal": made + cont == whole}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for e in engines.values():
                await e.agent.close()
                e.runner.stop()
    summary = []
    for n in CONTEXTS:
        rs = [r for r in rows if r["prompt_tokens"] == n]
        summary.append({
            "prompt_tokens": n, "context_tokens": sorted({r["context_tokens"] for r in rs}),
            "move_s_median": round(statistics.median(r["move_s"] for r in rs), 4),
            "recompute_s_median": round(statistics.median(r["recompute_s"] for r in rs), 4),
            "mbytes": round(rs[0]["bytes"] / 1e6, 1),
            "all_moved_and_equal": all(r["outcome"] == "moved" and r["continuation_equal"]
                                       for r in rs)})
    for s in summary:
        print(json.dumps(s))
    return {"command": "python benchmarks/bench_kv_moves.py", "model": "SmolLM2-135M",
            "engine": f"torch CPU, fp32 KV, block {BLOCK}, torch threads: every core",
            "transfer": "NIXL UCX over DRAM, two agents in one process",
            "tokens_before_park": BEFORE, "summary": summary, "runs": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/kv_moves.json")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    result = asyncio.run(main(args.repeats))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
