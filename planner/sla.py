"""SLA mode's arithmetic: predict the next interval's load, size a pool for it.

Pure functions over numbers; the core calls them once per pool per interval and the
tests drive them from tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from .config import PoolCapacity, SlaSettings
from .model import Observation

# Loads within this relative distance of a multiple of the capacity count as that
# multiple: 2.0000000001 replicas' worth of load (float noise) needs 2, not 3.
_EPS = 1e-9


def predict_constant(history: Sequence[float], window: int) -> float:
    """Next load = the last sample (what was seen is what will come)."""
    return history[-1]


def predict_moving_average(history: Sequence[float], window: int) -> float:
    """Next load = the mean of the last ``window`` samples (smooths bursts)."""
    recent = history[-window:]
    return sum(recent) / len(recent)


def predict_linear_trend(history: Sequence[float], window: int) -> float:
    """Next load = a least-squares line through the last ``window`` samples, one step on.

    Never negative (a falling trend bottoms out at zero); with one sample it is that
    sample.
    """
    ys = list(history[-window:])
    n = len(ys)
    if n == 1:
        return ys[0]
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sxx
    return max(0.0, mean_y + slope * (n - mean_x))


PREDICTORS: Mapping[str, Callable[[Sequence[float], int], float]] = MappingProxyType({
    "constant": predict_constant,
    "moving-average": predict_moving_average,
    "linear-trend": predict_linear_trend,
})


def predict(history: Sequence[float], predictor: str, window: int) -> float | None:
    """The predicted load of the next interval, or None with no history yet."""
    if not history:
        return None
    return PREDICTORS[predictor](history, window)


def replicas_needed(load: float, capacity: PoolCapacity) -> int:
    """Fewest replicas that carry ``load`` (in the capacity's unit) within the targets."""
    per_replica = capacity.tokens_per_s or capacity.requests_per_s
    assert per_replica is not None  # PoolCapacity guarantees exactly one is set
    if load <= 0:
        return 0
    return math.ceil(load / per_replica * (1 - _EPS))


def pool_load(observation: Observation, pool: str, capacity: PoolCapacity) -> float | None:
    """The observed load of ``pool`` in its capacity's unit, or None when unread.

    Prefill work is prompt tokens, decode work is generated tokens; in requests both
    pools see every request once.
    """
    if capacity.requests_per_s is not None:
        return observation.requests_per_s
    if pool == "prefill":
        return observation.prompt_tokens_per_s
    return observation.output_tokens_per_s


def latency_breach(observation: Observation, pool: str, sla: SlaSettings) -> str | None:
    """Why ``pool`` misses its latency target (TTFT for prefill, ITL for decode), or None."""
    if pool == "prefill":
        seen, target, name = observation.ttft_s, sla.ttft_s, "ttft"
    else:
        seen, target, name = observation.itl_s, sla.itl_s, "itl"
    if seen is None or target is None or seen <= target:
        return None
    return f"{name} {seen:.3g}s > target {target:.3g}s"


def remember(history: tuple[float, ...], load: float | None, window: int) -> tuple[float, ...]:
    """Append a load sample, keeping the last ``window``; no sample keeps the history."""
    if load is None:
        return history
    return (*history, load)[-window:]
