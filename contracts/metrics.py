"""Shared metric conventions: one prefix for every metric this project exports."""

from __future__ import annotations

PREFIX = "splitserve"


def latency_buckets() -> tuple[float, ...]:
    """Histogram buckets from 0.5 ms to 2 min: covers ITL on CPU and long-prompt TTFT."""
    return (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
            10.0, 20.0, 60.0, 120.0)
