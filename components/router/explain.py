"""Human-readable rendering of a ``Decision`` for ``dynamo route explain``."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .types import Decision


def decision_table(decision: Decision) -> Table:
    """Return a rich table: one row per worker considered, one column per scorer.

    Candidates are listed by total score (best first), then removed workers with the filter
    and reason that removed them.  Scorer cells read ``raw -> weighted``.
    """
    adapter = f" / adapter {decision.lora}" if decision.lora is not None else ""
    table = Table(title=f"request {decision.request_id} / profile {decision.profile}{adapter}")
    table.add_column("worker", justify="right")
    table.add_column("status")
    for breakdown in decision.scorers:
        table.add_column(f"{breakdown.plugin} (w={breakdown.weight:g})", justify="right")
    table.add_column("total", justify="right")
    ranked = sorted(decision.candidates, key=lambda w: (-decision.totals[w], w))
    for worker in ranked:
        status = "chosen" if worker == decision.worker_id else "candidate"
        cells = [f"{b.raw[worker]:.3f} -> {b.weighted[worker]:.3f}" for b in decision.scorers]
        table.add_row(str(worker), status, *cells, f"{decision.totals[worker]:.3f}")
    blanks = [""] * len(decision.scorers)
    for removal in decision.removed:
        table.add_row(str(removal.worker_id), f"removed by {removal.plugin}: {removal.reason}",
                      *blanks, "")
    return table


def _footer(decision: Decision) -> Text:
    chosen = "none" if decision.worker_id is None else str(decision.worker_id)
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
