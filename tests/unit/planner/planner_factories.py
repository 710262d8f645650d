"""Small builders for planner tests: policies from knobs, observations from numbers."""

from __future__ import annotations

from typing import Any

from splitserve.planner import Observation, PlannerPolicy, PoolObservation, parse_planner_policy

# The seed's autoscale section (configs/policies/seed.yaml), as a document.
SEED_AUTOSCALE: dict[str, Any] = {
    "prefill": {"min_replicas": 4, "max_replicas": 12,
                "scale_up": {"queue_length": 8, "gpu_utilization": 80},
                "scale_down": {"queue_length": 2, "gpu_utilization": 40}},
    "decode": {"min_replicas": 8, "max_replicas": 24,
               "scale_up": {"queue_length": 16, "kv_cache_usage": 75},
               "scale_down": {"queue_length": 4, "kv_cache_usage": 30}},
}

# No cooldown, no hysteresis: each rule test turns on only the knob it is about.
PLAIN = {"cooldown": {"scale_up_s": 0, "scale_down_s": 0},
         "hysteresis": {"scale_up_intervals": 1, "scale_down_intervals": 1}}


def pool(min_replicas: int = 1, max_replicas: int = 10, up: dict | None = None,
         down: dict | None = None) -> dict[str, Any]:
    """One pool's autoscale document; default thresholds on queue length 8 / 2."""
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "scale_up": up or {"queue_length": 8}, "scale_down": down or {"queue_length": 2}}


def policy(prefill: dict | None = None, decode: dict | None = None, *, seed: bool = False,
           **planner: Any) -> PlannerPolicy:
    """A validated planner policy: the given pools (or the seed's), ``PLAIN`` knobs
    overridden by ``planner``."""
    autoscale = dict(SEED_AUTOSCALE) if seed else {}
    if prefill is not None:
        autoscale["prefill"] = prefill
    if decode is not None:
        autoscale["decode"] = decode
    return parse_planner_policy({"autoscale": autoscale, "planner": {**PLAIN, **planner}})


def pobs(replicas: int, queue: float | None = None, util: float | None = None,
         kv: float | None = None) -> PoolObservation:
    """A pool observation: replicas, queue per replica, GPU util %, KV usage %."""
    return PoolObservation(replicas=replicas, queue_length=queue, gpu_utilization=util,
                           kv_cache_usage=kv, ready=replicas)


def obs(t: float = 0.0, prefill: PoolObservation | None = None,
        decode: PoolObservation | None = None, **rates: float | None) -> Observation:
    """An observation at time ``t``."""
    return Observation(time_s=t, prefill=prefill, decode=decode, **rates)
