"""Head-of-line blocking in the torch engine: short requests behind a long prompt.

One long decode is running when a 3,000-token prompt arrives together with seven short
requests (4 tokens each). The engine's step loop runs in process (no graph), so the
figures are the engine's own: how long the short requests take, and the longest pause
the running decode sees between two of its tokens (its worst inter-token latency), for
several per-step prefill budgets and per-sequence chunk caps.

    python benchmarks/bench_chunked_prefill.py [--out benchmarks/results/chunked_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from splitserve.components.engines.torch_cpu import (  # noqa: E402
    EngineConfig,
    EngineCore,
    Request,
    configure_threads,
    load_model,
)

SETTINGS = [(2048, None), (512, None), (512, 256), (256, 128)]


def scenario(model, budget: int, chunk: int | None, long_prompt: int) -> dict:
    """Run the scenario once on a fresh engine; times in seconds."""
    engine = EngineCore(model.weights, model.config, EngineConfig(
        num_blocks=1024, max_prefill_tokens=budget, max_chunk_tokens=chunk))
    tok = model.tokenizer
    engine.add_request(Request("decode", tuple(tok("Tell me a long story.")["input_ids"]),
                               max_tokens=10_000, min_tokens=10_000))
    for _ in range(3):  # the decode is running
        engine.step()
    words = ("the quick brown fox jumps over the lazy dog " * 400).split()
    long_ids = tuple(tok(" ".join(words))["input_ids"][:long_prompt])
    t0 = time.perf_counter()
    engine.add_request(Request("long", long_ids, max_tokens=1))
    for i in range(7):
        engine.add_request(Request(f"short{i}", tuple(tok(f"Question {i}: name a colour.")
                                                      ["input_ids"]), max_tokens=4))
    done: dict[str, float] = {}
    last_decode, worst_gap = t0, 0.0
    while len(done) < 8:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id == "decode" and o.new_token_ids:
                worst_gap, last_decode = max(worst_gap, now - last_decode), now
            elif o.finished:
                done[o.request_id] = now - t0
    engine.abort("decode")
    shorts = [v for k, v in done.items() if k.startswith("short")]
    return {"max_prefill_tokens": budget, "max_chunk_tokens": chunk,
            "short_p50_s": statistics.median(shorts), "short_max_s": max(shorts),
            "long_prompt_s": done["long"], "decode_worst_gap_s": worst_gap}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-prompt", type=int, default=3000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/chunked_prefill.json"))
    args = p.parse_args(argv)
    configure_threads(args.threads)
    model = load_model()
    rows = []
    for budget, chunk in SETTINGS:
        row = scenario(model, budget, chunk, args.long_prompt)
        rows.append(row)
        print(f"budget {budget:5d} chunk {chunk or budget:5d}: short requests p50 "
              f"{row['short_p50_s']:.2f} s max {row['short_max_s']:.2f} s; long prompt "
              f"{row['long_prompt_s']:.2f} s; running decode's worst gap "
              f"{row['decode_worst_gap_s']:.2f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/bench_chunked_prefill.py "
                               + " ".join(argv if argv is not None else sys.argv[1:]),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
