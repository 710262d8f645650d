"""The metrics a score-based offload rule can test, and how each is read."""

from __future__ import annotations

from typing import Literal, get_args

from .types import OffloadRequest, OffloadSnapshot

Metric = Literal["prefill_length", "prompt_length", "prefill_queue_depth",
                 "decode_active_requests", "decode_kv_usage", "priority"]

METRICS: tuple[str, ...] = get_args(Metric)

# Metrics compared as `value >= threshold`; `priority` is matched against a class list.
NUMERIC_METRICS: frozenset[str] = frozenset(METRICS) - {"priority"}

# Metrics that are fractions, whose threshold must lie in [0, 1].
FRACTION_METRICS: frozenset[str] = frozenset({"decode_kv_usage"})


def metric_value(metric: str, request: OffloadRequest, snapshot: OffloadSnapshot) -> float:
    """Return a numeric metric's current value:

    - ``prefill_length``: prompt tokens left after this worker's prefix-cache hit;
    - ``prompt_length``: prompt tokens, ignoring the cache;
    - ``prefill_queue_depth``: requests waiting in the prefill queue;
    - ``decode_active_requests``: requests this decode worker is serving;
    - ``decode_kv_usage``: fraction of this worker's KV blocks in use (0..1).
    """
    if metric == "prefill_length":
        return float(request.prefill_length)
    if metric == "prompt_length":
        return float(request.prompt_length)
    if metric == "prefill_queue_depth":
        return float(snapshot.prefill_queue_depth)
    if metric == "decode_active_requests":
        return float(snapshot.decode_active_requests)
    if metric == "decode_kv_usage":
        return snapshot.decode_kv_usage
    raise ValueError(f"{metric!r} is not a numeric metric")
