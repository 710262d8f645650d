"""Where a parallel run's wall time went, from the gate's trace (tests/parallel.py).

    SPLITSERVE_GATE_TRACE=gate.jsonl python -m pytest -q -n 3 --dist loadscope \\
        --no-loadscope-reorder -m "not deep"
    python tests/gate_trace.py gate.jsonl

Prints, per kind of module, how many ran, their summed run time and the time they waited
at the gate; the run's phases (how many workers ran a module, second by second, grouped);
and the longest modules with their waits.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(rows: list[dict]) -> str:
    t0 = min(r["asked"] for r in rows)
    end = max(r["ended"] for r in rows)
    out = [f"{len(rows)} modules, {end - t0:.0f} s from the first ask to the last end"]
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    out.append(f"{'kind':<10}{'modules':>8}{'run s':>9}{'waited s':>10}")
    for k, rs in sorted(by_kind.items()):
        run = sum(r["ended"] - r["started"] for r in rs)
        wait = sum(r["started"] - r["asked"] for r in rs)
        out.append(f"{k:<10}{len(rs):>8}{run:>9.0f}{wait:>10.0f}")
    # Phases: which kinds ran, per 10 s window (the busiest second of each worker).
    out.append("\nper 30 s: modules running by kind (e=exclusive q=quiet m=model h=heavy "
               "l=light), worker-seconds idle at the gate")
    letter = {"exclusive": "e", "quiet": "q", "model": "m", "heavy": "h", "light": "l"}
    step = 30
    t = t0
    while t < end:
        w_end = t + step
        kinds = defaultdict(float)
        waiting = 0.0
        for r in rows:
            lo, hi = max(t, r["started"]), min(w_end, r["ended"])
            if hi > lo:
                kinds[letter[r["kind"]]] += hi - lo
            lo, hi = max(t, r["asked"]), min(w_end, r["started"])
            if hi > lo:
                waiting += hi - lo
        mix = " ".join(f"{k}{v / step:.1f}" for k, v in sorted(kinds.items()))
        out.append(f"{t - t0:6.0f}s  {mix:<32} waiting {waiting:5.0f}")
        t = w_end
    out.append("\nlongest modules (run s, waited s)")
    for r in sorted(rows, key=lambda r: r["started"] - r["ended"])[:20]:
        out.append(f"{r['ended'] - r['started']:7.1f} {r['started'] - r['asked']:7.1f}  "
                   f"{r['kind']:<9} {r['module'].split('/tests/', 1)[-1]}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(load(sys.argv[1])))
