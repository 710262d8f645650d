"""Decode throughput of the torch CPU engine versus transformers ``generate``.

Same model (SmolLM2-135M-Instruct, fp32), same prompts, greedy, a fixed number
of new tokens per request. Decode tokens/s counts generated tokens over the time
spent after the first token (prefill excluded for both).

    python benchmarks/bench_engine.py [--new-tokens 64] [--threads N]

Prints a table and writes benchmarks/results/engine_decode.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from splitserve.components.engines.torch_cpu import (
    EngineConfig,
    EngineCore,
    Request,
    chat_prompt_ids,
    configure_threads,
    load_model,
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for better sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "How do I boil an egg?",
    "What are prime numbers?",
    "Summarise the plot of Romeo and Juliet.",
    "What does a CPU do?",
    "Name three famous painters.",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
]


def engine_decode_tps(loaded, prompts: list[list[int]], new_tokens: int) -> float:
    """Run all prompts concurrently; return generated tokens/s after every first token."""
    engine = EngineCore(
        loaded.weights, loaded.config, EngineConfig(num_blocks=256, max_prefill_tokens=1024)
    )
    for i, p in enumerate(prompts):
        # No stop tokens beyond the model's EOS; max_tokens bounds the work.
        engine.add_request(Request(f"r{i}", tuple(p), max_tokens=new_tokens))
    first_done: float | None = None
    generated_after = 0
    seen: set[str] = set()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in seen:
                generated_after += len(o.new_token_ids)
            else:
                seen.add(o.request_id)
                generated_after += len(o.new_token_ids) - 1
        if first_done is None and len(seen) == len(prompts):
            first_done, generated_after = now, 0
    return generated_after / (time.perf_counter() - first_done)


def hf_decode_tps(loaded, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers generate (batched with left padding when several prompts)."""
    hf, tok = loaded.hf_model, loaded.tokenizer
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = {"attention_mask": mask, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - t0
    return len(prompts) * (new_tokens - 1) / (total - t_first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="best of N runs per cell")
    ap.add_argument("--out", default="benchmarks/results/engine_decode.json")
    args = ap.parse_args()
    threads = configure_threads(args.threads)
    loaded = load_model(progress=lambda stage, frac: None, keep_hf_model=True)
    prompts = [
        chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS
    ]
    rows = []
    for conc in (1, 16):
        batch = prompts[:conc]
        ours = max(engine_decode_tps(loaded, batch, args.new_tokens) for _ in range(args.repeats))
        hf = max(hf_decode_tps(loaded, batch, args.new_tokens) for _ in range(args.repeats))
        rows.append({"concurrency": conc, "engine_tok_s": ours, "hf_tok_s": hf})
    hf1 = rows[0]["hf_tok_s"]
    print(
        f"{'concurrency':>11} {'engine tok/s':>13} {'HF tok/s':>9} {'vs HF same':>11} {'vs HF@1':>8}"
    )
    for r in rows:
        r["speedup_vs_hf_same"] = r["engine_tok_s"] / r["hf_tok_s"]
        r["speedup_vs_hf_1"] = r["engine_tok_s"] / hf1
        print(
            f"{r['concurrency']:>11} {r['engine_tok_s']:>13.1f} {r['hf_tok_s']:>9.1f} "
            f"{r['speedup_vs_hf_same']:>10.2f}x {r['speedup_vs_hf_1']:>7.2f}x"
        )
    result = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 de-quantised to fp32)",
        "new_tokens": args.new_tokens,
        "threads": threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
