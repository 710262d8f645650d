"""Token timing of one request at a time through the two disaggregations of
``disagg_peer`` (this project's graph with every prefill remote, and Dynamo's), on the
held-out cases' fleet: per request the first token, the gap from the first to the
second token, and the mean gap after it; medians of 16 requests of ~3,000 prompt tokens
and 25 output tokens.

    python benchmarks/disagg_token_gaps.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import disagg_peer as dp  # noqa: E402
import heldout as h  # noqa: E402
from compare import MODEL  # noqa: E402


def token_times(url: str, prompt: str, max_tokens: int) -> list[float]:
    """Seconds from sending to each streamed text chunk."""
    t0, times = time.monotonic(), []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                choices = json.loads(line[5:]).get("choices") or [{}]
                if choices[0].get("text"):
                    times.append(time.monotonic() - t0)
    return times


def probe(url: str, n: int = 16) -> dict:
    first, gap, later = [], [], []
    for _ in range(n):
        prompt = f"{time.time()} " + " ".join(f"w{j}" for j in range(1500))
        t = token_times(url, prompt, 25)
        if len(t) >= 3:
            first.append(t[0])
            gap.append(t[1] - t[0])
            later.append((t[-1] - t[1]) / (len(t) - 2))
    med = statistics.median
    return {"requests": len(first), "ttft_ms": round(1000 * med(first)),
            "gap_1_2_ms": round(1000 * med(gap), 1), "later_gaps_ms": round(1000 * med(later), 1)}


def main() -> None:
    geo = h.geometry()
    with dp.ours(2, 2, geo, 180, [dp.FORCED_REMOTE]) as g:
        h.wait_ready(g.url, 60, 4, True)
        print("splitserve-disagg-remote", probe(g.url), flush=True)
    with dp.dynamo(2, 2, geo, 180) as (fe, url, _):
        h.wait_ready(url, 90, 4, True, fe)
        print("dynamo-disagg", probe(url), flush=True)


if __name__ == "__main__":
    main()
