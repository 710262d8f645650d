"""Small factories for disaggregated-router test inputs."""

from __future__ import annotations

from typing import Any

from splitserve.components.disagg import OffloadRequest, OffloadSnapshot


def offload_request(prompt: int, cached: int = 0, priority: str = "default") -> OffloadRequest:
    """A request of ``prompt`` tokens with ``cached`` of them in this worker's prefix cache."""
    return OffloadRequest(request_id="req-1", prompt_length=prompt, prefix_cached_length=cached,
                          priority=priority)


def offload_snapshot(queue: int = 0, active: int = 0, kv: float = 0.0,
                     prefill_workers: int = 2) -> OffloadSnapshot:
    """Load as the decode worker sees it; two live prefill workers unless told otherwise."""
    return OffloadSnapshot(prefill_queue_depth=queue, decode_active_requests=active,
                           decode_kv_usage=kv, live_prefill_workers=prefill_workers)


def rule(metric: str, action: str = "prefer_remote", weight: float = 1.0,
         **condition: Any) -> dict[str, Any]:
    """One score-policy rule as it would appear in YAML."""
    return {"metric": metric, "action": action, "weight": weight, **condition}
