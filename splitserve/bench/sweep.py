"""Aggregating replay results over offered loads and configurations (pure functions).

A *point* is one replay of one configuration at one load, reduced to a flat dict (see
:func:`point_from_result`).  A sweep is a list of points; the comparison table divides
this project's figures by the best other configuration's at the same load.
"""

from __future__ import annotations

import math
from typing import Any

POINT_FIELDS = ("config", "rate_scale", "offered_rps", "requests", "ok", "rejected", "errors",
                "goodput_rps", "slo_attainment", "throughput_rps", "output_tps",
                "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms",
                "e2e_p99_ms", "makespan_s")


def parse_rate_scales(text: str) -> list[float]:
    """``"2,4,8"`` -> ``[2.0, 4.0, 8.0]`` (positive, at least one, order kept)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"not a number: {part!r}") from None
        if not v > 0 or math.isinf(v):
            raise ValueError(f"rate scales must be finite and > 0, got {part!r}")
        out.append(v)
    if not out:
        raise ValueError("no rate scales given")
    return out


def point_from_result(result: dict, config: str, rate_scale: float) -> dict[str, Any]:
    """One replay result (``run_replay``'s dict) -> a flat point."""
    s = result["summary"]
    oc = s.get("outcomes", {})
    ok = oc.get("ok", 0)
    return {
        "config": config, "rate_scale": rate_scale,
        "offered_rps": (result.get("workload") or {}).get("offered_rps"),
        "requests": s["requests"], "ok": ok, "rejected": oc.get("rejected", 0),
        "errors": s["requests"] - ok - oc.get("rejected", 0),
        "goodput_rps": _finite(s.get("goodput_rps")),
        "slo_attainment": s.get("slo_attainment"),
        "throughput_rps": _finite(s.get("request_throughput_rps")),
        "output_tps": _finite(s.get("output_token_throughput_tps")),
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
        "e2e_p50_ms": s["e2e_ms"]["p50"], "e2e_p99_ms": s["e2e_ms"]["p99"],
        "makespan_s": s.get("makespan_s"),
    }


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def by_config(points: list[dict]) -> dict[str, list[dict]]:
    """Points grouped by configuration, each group sorted by offered load (rate scale)."""
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["config"], []).append(p)
    for ps in out.values():
        ps.sort(key=lambda p: (p["rate_scale"], p.get("offered_rps") or 0.0))
    return out


def peak_goodput(points: list[dict]) -> dict | None:
    """The point with the highest goodput (ties: the lower load), or None."""
    best = None
    for p in sorted(points, key=lambda p: p["rate_scale"]):
        g = p.get("goodput_rps")
        if g is not None and (best is None or g > best["goodput_rps"]):
            best = p
    return best


def saturation_point(points: list[dict], attainment: float = 0.9) -> dict | None:
    """The lowest load at which fewer than ``attainment`` of the requests met the SLO
    (the fleet no longer keeps up), or None if every load was served."""
    for p in sorted(points, key=lambda p: p["rate_scale"]):
        a = p.get("slo_attainment")
        if a is None or a < attainment:
            return p
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def ratio_table(points: list[dict], ours: list[str], others: list[str]) -> list[dict]:
    """Per load (rate scale) and per configuration of ours: goodput ÷ the best other
    goodput (higher is better) and p99 TTFT ÷ the best (lowest) other p99 TTFT (lower is
    better).  Others that did not run at a load are left out of its best."""
    table = []
    scales = sorted({p["rate_scale"] for p in points})
    idx = {(p["config"], p["rate_scale"]): p for p in points}
    for rs in scales:
        rivals = [idx[(c, rs)] for c in others if (c, rs) in idx]
        good = [p for p in rivals if p.get("goodput_rps") is not None]
        fast = [p for p in rivals if p.get("ttft_p99_ms") is not None]
        best_g = max(good, key=lambda p: p["goodput_rps"]) if good else None
        best_t = min(fast, key=lambda p: p["ttft_p99_ms"]) if fast else None
        for c in ours:
            p = idx.get((c, rs))
            if p is None:
                continue
            table.append({
                "rate_scale": rs, "offered_rps": p.get("offered_rps"), "config": c,
                "goodput_rps": p.get("goodput_rps"),
                "best_other_goodput": None if best_g is None else best_g["config"],
                "best_other_goodput_rps": None if best_g is None else best_g["goodput_rps"],
                "goodput_ratio": _ratio(p.get("goodput_rps"),
                                        None if best_g is None else best_g["goodput_rps"]),
                "ttft_p99_ms": p.get("ttft_p99_ms"),
                "best_other_ttft": None if best_t is None else best_t["config"],
                "best_other_ttft_p99_ms": None if best_t is None else best_t["ttft_p99_ms"],
                "ttft_p99_ratio": _ratio(p.get("ttft_p99_ms"),
                                         None if best_t is None else best_t["ttft_p99_ms"]),
            })
    return table


def peak_ratio(points: list[dict], ours: str, others: list[str]) -> dict:
    """Peak goodput of ``ours`` (over all loads) ÷ the best peak of ``others``."""
    groups = by_config(points)
    mine = peak_goodput(groups.get(ours, []))
    peaks = {c: peak_goodput(groups.get(c, [])) for c in others}
    peaks = {c: p for c, p in peaks.items() if p is not None}
    best = max(peaks.values(), key=lambda p: p["goodput_rps"]) if peaks else None
    return {"config": ours, "peak_goodput_rps": None if mine is None else mine["goodput_rps"],
            "at_rate_scale": None if mine is None else mine["rate_scale"],
            "best_other": None if best is None else best["config"],
            "best_other_peak_goodput_rps": None if best is None else best["goodput_rps"],
            "best_other_at_rate_scale": None if best is None else best["rate_scale"],
            "ratio": _ratio(None if mine is None else mine["goodput_rps"],
                            None if best is None else best["goodput_rps"])}


def fmt(x: float | None, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return format(x, spec)


def markdown_points(points: list[dict]) -> str:
    """A markdown table of points (one row per configuration and load)."""
    head = ("| config | rate x | offered req/s | ok / sent | goodput req/s | SLO met | "
            "TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2E p99 ms |")
    lines = [head, "|" + "---|" * 9]
    for c, ps in by_config(points).items():
        for p in ps:
            lines.append(
                f"| {c} | {fmt(p['rate_scale'], 'g')} | {fmt(p['offered_rps'], '.1f')} | "
                f"{p['ok']} / {p['requests']} | {fmt(p['goodput_rps'])} | "
                f"{fmt(None if p['slo_attainment'] is None else 100 * p['slo_attainment'], '.0f')}"
                f"% | {fmt(p['ttft_p50_ms'], '.0f')} / {fmt(p['ttft_p99_ms'], '.0f')} | "
                f"{fmt(p['tpot_p50_ms'], '.1f')} / {fmt(p['tpot_p99_ms'], '.1f')} | "
                f"{fmt(p['e2e_p99_ms'], '.0f')} |")
    return "\n".join(lines)


def markdown_ratios(table: list[dict]) -> str:
    lines = [("| rate x | offered req/s | config | goodput | best other (goodput) | goodput ratio "
              "| TTFT p99 ms | best other (TTFT p99) | TTFT p99 ratio |"), "|" + "---|" * 9]
    for r in table:
        lines.append(
            f"| {fmt(r['rate_scale'], 'g')} | {fmt(r['offered_rps'], '.1f')} | {r['config']} | "
            f"{fmt(r['goodput_rps'])} | {r['best_other_goodput'] or '-'} "
            f"({fmt(r['best_other_goodput_rps'])}) | {fmt(r['goodput_ratio'])} | "
            f"{fmt(r['ttft_p99_ms'], '.0f')} | {r['best_other_ttft'] or '-'} "
            f"({fmt(r['best_other_ttft_p99_ms'], '.0f')}) | {fmt(r['ttft_p99_ratio'])} |")
    return "\n".join(lines)
