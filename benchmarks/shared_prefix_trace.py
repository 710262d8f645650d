"""A Mooncake-format trace whose long prompts share long prefixes: documents (or system
prompts, or agent contexts) that many requests open with, each request adding its own
question.  Written for the admission benchmarks' sustained-overload case, whose
conversation trace repeats fewer of its blocks than the traffic users report.

    python benchmarks/shared_prefix_trace.py --out /tmp/shared.jsonl
    python benchmarks/shared_prefix_trace.py --out /tmp/shared.jsonl --stats
    python benchmarks/shared_prefix_trace.py --shape groups --out /tmp/groups.jsonl

Shape (defaults): 40 prefixes of 4 to 8 blocks of 512 tokens (2k to 4k tokens),
picked by a Zipf law (s = 1.1), so a few are hot and most are warm; a suffix of 3 to 7
blocks of the request's own; answers of 64 to 640 trace tokens (short once a benchmark
divides them); Poisson arrivals at ``--rps`` for ``--seconds``.  About 55% of the prompt
blocks repeat an earlier request's, and a prefix's first requests arrive together,
before any worker has computed it.  Deterministic for a seed.

Shape ``groups``: every prefix (6 to 11 blocks) is new and is opened by a group of 2 to
6 requests within 3 s, each adding 2 to 5 blocks of its own, and never used again:
about half the prompt blocks repeat, nearly all of them while the group's first
request is still queued.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512  # tokens per hash id (Mooncake's)


class _BlockIds:
    """Fresh hash ids for a trace: each call hands out ``n`` never handed out before."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def generate(*, prefixes: int = 40, prefix_blocks: tuple[int, int] = (4, 8),
             suffix_blocks: tuple[int, int] = (3, 7), output: tuple[int, int] = (64, 640),
             zipf_s: float = 1.1, rps: float = 20.0, seconds: float = 600.0,
             seed: int = 0) -> list[dict]:
    """The trace's rows, in arrival order (``timestamp`` in ms)."""
    rng = random.Random(seed)
    ids = _BlockIds()

    docs = [ids(rng.randint(*prefix_blocks)) for _ in range(prefixes)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(prefixes)]
    rows, t = [], 0.0
    while True:
        t += rng.expovariate(rps)
        if t >= seconds:
            return rows
        doc = rng.choices(docs, weights)[0]
        own = ids(rng.randint(*suffix_blocks))
        # the last block is partly filled, as real prompts are
        length = (len(doc) + len(own) - 1) * BLOCK + rng.randint(1, BLOCK)
        rows.append({"timestamp": round(t * 1000), "input_length": length,
                     "output_length": rng.randint(*output), "hash_ids": doc + own})


def generate_groups(*, group: tuple[int, int] = (2, 6), window_s: float = 3.0,
                    prefix_blocks: tuple[int, int] = (6, 11),
                    suffix_blocks: tuple[int, int] = (2, 5),
                    output: tuple[int, int] = (64, 640), rps: float = 20.0,
                    seconds: float = 600.0, seed: int = 0) -> list[dict]:
    """The ``groups`` shape's rows, in arrival order: every prefix is new and is opened
    by one group of ``group`` requests arriving within ``window_s`` of each other (an
    agent's parallel calls, a document asked several questions at once), then never
    again.  Most shared blocks are thus requested while the group's first request is
    still queued: no worker has them yet.  Groups start as a Poisson process so that
    requests arrive at ``rps`` on average."""
    rng = random.Random(seed)
    ids = _BlockIds()

    rows, t = [], 0.0
    mean_group = (group[0] + group[1]) / 2
    while True:
        t += rng.expovariate(rps / mean_group)
        if t >= seconds:
            break
        doc = ids(rng.randint(*prefix_blocks))
        for _ in range(rng.randint(*group)):
            at = t + rng.uniform(0.0, window_s)
            if at >= seconds:
                continue
            own = ids(rng.randint(*suffix_blocks))
            length = (len(doc) + len(own) - 1) * BLOCK + rng.randint(1, BLOCK)
            rows.append({"timestamp": round(at * 1000), "input_length": length,
                         "output_length": rng.randint(*output), "hash_ids": doc + own})
    rows.sort(key=lambda r: r["timestamp"])
    return rows


SHAPES = {"zipf": generate, "groups": generate_groups}


def repeated_share(rows: list[dict]) -> float:
    """The share of prompt blocks that an earlier request of ``rows`` already had."""
    seen: set[int] = set()
    total = repeated = 0
    for r in rows:
        for h in r["hash_ids"]:
            total += 1
            repeated += h in seen
        seen.update(r["hash_ids"])
    return repeated / total if total else 0.0


def write(path: str | Path, shape: str = "zipf", **kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in SHAPES[shape](**kwargs)))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=list(SHAPES), default="zipf", help="zipf: 40 "
                   "prefixes reused all along; groups: each prefix opened by one group "
                   "of requests within seconds, then never again")
    p.add_argument("--prefixes", type=int, default=40, help="zipf only")
    p.add_argument("--rps", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats", action="store_true", help="print the repeated-block share "
                   "over the whole trace and over its first 60 s")
    a = p.parse_args(argv)
    extra = {"prefixes": a.prefixes} if a.shape == "zipf" else {}
    path = write(a.out, a.shape, rps=a.rps, seconds=a.seconds, seed=a.seed, **extra)
    if a.stats:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        first = [r for r in rows if r["timestamp"] < 60_000]
        print(json.dumps({"requests": len(rows), "repeated_share": round(
            repeated_share(rows), 3), "repeated_share_first_60s": round(
            repeated_share(first), 3), "mean_input": round(
            sum(r["input_length"] for r in rows) / len(rows))}))


if __name__ == "__main__":
    main()
