"""Human-readable rendering of a ``Decision`` for ``dynamo route explain``, and the
same decision as trace spans (``trace_placement``)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from splitserve.contracts.block_events import TIERS

from splitserve.contracts import tracing

from .types import Decision


def decision_table(decision: Decision) -> Table:
    """Return a rich table: one row per worker considered, one column per scorer.

    Candidates are listed by total score (best first), then removed workers with the filter
    and reason that removed them, each named by ``worker_label``.  Scorer cells read
    ``raw -> weighted``.  With the KV tiers' view (``Decision.tier_hits``), a column gives
    each candidate's prefix hit in blocks per tier, ``device / host / disk``.
    """
    adapter = f" / adapter {decision.lora}" if decision.lora is not None else ""
    table = Table(title=f"request {decision.request_id} / profile {decision.profile}{adapter}")
    table.add_column("worker", justify="right")
    table.add_column("status")
    tiers = bool(decision.tier_hits)
    if tiers:
        table.add_column("hit blocks device/host/disk", justify="right")
    for breakdown in decision.scorers:
        table.add_column(f"{breakdown.plugin} (w={breakdown.weight:g})", justify="right")
    table.add_column("total", justify="right")
    ranked = sorted(decision.candidates, key=lambda w: (-decision.totals[w], w))
    for worker in ranked:
        status = "chosen" if worker == decision.worker_id else "candidate"
        cells = [f"{b.raw[worker]:.3f} -> {b.weighted[worker]:.3f}" for b in decision.scorers]
        if tiers:
            cells.insert(0, tier_cell(decision.tier_hits.get(worker, {})))
        table.add_row(worker_label(worker), status, *cells, f"{decision.totals[worker]:.3f}")
    blanks = [""] * (len(decision.scorers) + tiers)
    for removal in decision.removed:
        table.add_row(worker_label(removal.worker_id),
                      f"removed by {removal.plugin}: {removal.reason}", *blanks, "")
    return table


def worker_label(worker: int) -> str:
    """A worker's id as ``dynamo status``, the metrics' ``worker`` label and the trace
    attributes write it: lower-case hex, no prefix."""
    return f"{worker:x}"


def tier_cell(hits: dict[str, int]) -> str:
    """One candidate's prefix hit per tier, ``device / host / disk`` blocks."""
    return " / ".join(str(hits.get(tier, 0)) for tier in TIERS)


def _footer(decision: Decision) -> Text:
    chosen = "none" if decision.worker_id is None else worker_label(decision.worker_id)
    lines = [f"chosen: {chosen} ({decision.reason})"]
    lines += [f"note from {plugin}: {note}" for plugin, note in decision.notes.items()]
    if decision.elapsed_ns:
        timings = ", ".join(f"{plugin} {ns / 1000:.1f}us"
                            for plugin, ns in decision.elapsed_ns.items())
        lines.append(f"time: {timings}")
    return Text("\n".join(lines))


def format_decision(decision: Decision, width: int = 120) -> str:
    """Return the decision as plain text (no colour codes), for logs and terminals."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, legacy_windows=False)
    console.print(Group(decision_table(decision), _footer(decision)))
    return buffer.getvalue()


def routing_attributes(decision: Decision) -> dict[str, Any]:
    """The ``routing`` span's attributes: the chosen worker, why, and each scorer's raw
    and weighted score for it (``splitserve.score.<scorer>`` / ``...weighted``)."""
    wid = decision.worker_id
    attrs: dict[str, Any] = {
        "splitserve.route.profile": decision.profile, "splitserve.route.reason":
        decision.reason, "splitserve.route.candidates": len(decision.candidates),
        "splitserve.route.removed": len(decision.removed),
        "splitserve.worker_id": worker_label(wid) if wid is not None else None}
    if wid is not None:
        attrs["splitserve.route.total"] = decision.totals.get(wid)
        for b in decision.scorers:
            attrs[f"splitserve.score.{b.plugin}"] = b.raw.get(wid)
            attrs[f"splitserve.score.{b.plugin}.weighted"] = b.weighted.get(wid)
    return attrs


def trace_placement(decision: Decision | None, admission: Any, started: float,
                    record: bool = True) -> None:
    """Record one placement as two spans under the ambient trace (the caller's,
    ``tracing.active``): ``routing`` (the policy's pick, its plugins' time) then
    ``admission`` (admission's verdict on it: predicted TTFT and TPOT against the class's
    limits, and the worker the request goes to).  ``started``: ``time.monotonic()`` when
    the decision began; nothing is recorded for a decision only explained
    (``record`` False)."""
    if not record or not tracing.enabled():
        return
    v = admission.verdict
    worker_id = (admission.worker_id if admission.rerouted else
                 decision.worker_id if v.admit and decision is not None else None)
    begin = tracing.wall_ns(started)
    routed = begin
    if decision is not None:
        routed = begin + sum(decision.elapsed_ns.values())
        tracing.record("routing", None, begin, routed, routing_attributes(decision))
    tracing.record("admission", None, routed, max(routed, tracing.now_ns()), {
        "splitserve.admission.admit": v.admit, "splitserve.admission.reason": v.reason,
        "splitserve.admission.verdict": ("shadow-reject" if v.would_reject else
                                         "admit" if v.admit else "reject"),
        "splitserve.priority_class": v.class_name,
        "splitserve.predicted_ttft_ms": v.est_ttft_ms,
        "splitserve.ttft_limit_ms": v.limit_ms,
        "splitserve.predicted_tpot_ms": v.est_tpot_ms,
        "splitserve.tpot_limit_ms": v.tpot_limit_ms,
        "splitserve.admission.rerouted": bool(admission.rerouted),
        "splitserve.worker_id": f"{worker_id:x}" if worker_id is not None else None,
        "splitserve.degrade": [d.kind for d in v.degrade] or None})
