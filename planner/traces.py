"""Request traces for the simulator: Mooncake JSONL and Azure LLM inference CSV.

Mooncake rows are ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
Azure rows are ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock timestamps.
Both become ``TraceRequest``s with arrival times in seconds from the trace's first row.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    """One request: arrival (s from the trace's start), prompt and output lengths (tokens)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int


def _mooncake(path: Path) -> list[tuple[float, int, int]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                             int(row["output_length"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row: {exc}") from None
    return rows


def _azure_time(text: str) -> float:
    # Seven fractional digits, which strptime's %f (six at most) refuses.
    whole, _, frac = text.strip().partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or 0}")


def _azure(path: Path) -> list[tuple[float, int, int]]:
    rows = []
    with path.open(encoding="utf-8", newline="") as fh:
        for n, row in enumerate(csv.DictReader(fh), 2):
            try:
                rows.append((_azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not an Azure trace row: {exc}") from None
    return rows


def trace_format(path: Path) -> str:
    """``mooncake`` for ``.jsonl``/``.json``, ``azure`` for ``.csv``; raises otherwise."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    raise ValueError(f"{path}: unknown trace format {suffix!r} (use .jsonl or .csv)")


def load_trace(path: Path | str, start_s: float = 0.0,
               duration_s: float | None = None) -> list[TraceRequest]:
    """Read a trace, rebase it to its first arrival and keep ``[start_s, start_s +
    duration_s)``, shifted so the window starts at 0; sorted by arrival."""
    path = Path(path)
    raw = _mooncake(path) if trace_format(path) == "mooncake" else _azure(path)
    if not raw:
        return []
    raw.sort(key=lambda r: r[0])
    origin = raw[0][0] + start_s
    end = float("inf") if duration_s is None else origin + duration_s
    return [TraceRequest(t - origin, i, o) for t, i, o in raw if origin <= t < end]
