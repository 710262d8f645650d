"""Graceful degradation: what admission asks the adapter to do to an admitted request.

Steps, in this order, for admitted requests of classes with ``may_degrade`` only (each one
switchable in ``degradation``)::

    cap-max-tokens             fires when (estimate usable and est_ttft_ms >= est_ttft_ratio
                               x class.ttft_ms) or decode_kv_usage >= kv_usage_threshold;
                               limit = min(limit, max_tokens)
    local-prefill              fires when prefill_queue_depth >= prefill_queue_depth_threshold;
                               the decode worker prefills the request itself
    adaptive-generation-limit  fires when estimate observed and est_tpot_ms > class.tpot_ms;
                               limit = max(min_tokens, floor(limit x tpot_ms / est_tpot_ms))

``limit`` starts at the request's ``max_tokens``; a token step is returned only when it
lowers the limit, so ``value`` is always the new effective limit.  The adaptive step keeps
the request's expected decode time (limit x TPOT) at what it would have been at the class's
target TPOT.  It needs only measured decode rates, not a fresh backlog: TPOT does not
depend on the queue in front of the request.
"""

from __future__ import annotations

import math

from .classes import PriorityClass
from .degrade_config import DegradationConfig
from .types import AdmissionRequest, Degradation, Estimate, LoadSignals


def _cap(limit: int, cls: PriorityClass, estimate: Estimate | None, load: LoadSignals,
         config: DegradationConfig) -> Degradation | None:
    step = config.cap_max_tokens
    if not step.enable or limit <= step.max_tokens:
        return None
    if (estimate is not None and estimate.usable
            and estimate.est_ttft_ms >= step.est_ttft_ratio * cls.ttft_ms):
        detail = f"est-ttft>={step.est_ttft_ratio:g}x{cls.ttft_ms:g}ms"
    elif load.decode_kv_usage >= step.kv_usage_threshold:
        detail = f"kv-usage>={step.kv_usage_threshold:g}"
    else:
        return None
    return Degradation(kind="cap-max-tokens", detail=detail, value=step.max_tokens)


def _local_prefill(load: LoadSignals, config: DegradationConfig) -> Degradation | None:
    step = config.disable_remote_prefill_for_low_priority
    if not step.enable or load.prefill_queue_depth < step.prefill_queue_depth_threshold:
        return None
    return Degradation(kind="local-prefill",
                       detail=f"prefill-queue-depth>={step.prefill_queue_depth_threshold}",
                       value=load.prefill_queue_depth)


def _adaptive(limit: int, cls: PriorityClass, estimate: Estimate | None,
              config: DegradationConfig) -> Degradation | None:
    step = config.adaptive_generation_limit
    if (not step.enable or estimate is None or estimate.decode_source == "warmup"
            or estimate.est_tpot_ms <= cls.tpot_ms):
        return None
    scaled = max(step.min_tokens, math.floor(limit * cls.tpot_ms / estimate.est_tpot_ms))
    if scaled >= limit:
        return None
    return Degradation(kind="adaptive-generation-limit",
                       detail=f"est-tpot>{cls.tpot_ms:g}ms", value=scaled)


def plan_degradations(request: AdmissionRequest, cls: PriorityClass,
                      estimate: Estimate | None, load: LoadSignals,
                      config: DegradationConfig) -> tuple[tuple[Degradation, ...], int]:
    """Return the steps for one admitted request and its effective ``max_tokens``.

    Called by ``admit`` after the request was admitted; returns no steps (and the request's
    own ``max_tokens``) for classes without ``may_degrade``.
    """
    limit = request.max_tokens
    if not cls.may_degrade:
        return (), limit
    steps: list[Degradation] = []
    cap = _cap(limit, cls, estimate, load, config)
    if cap is not None:
        steps.append(cap)
        limit = int(cap.value or limit)
    local = _local_prefill(load, config)
    if local is not None:
        steps.append(local)
    adaptive = _adaptive(limit, cls, estimate, config)
    if adaptive is not None:
        steps.append(adaptive)
        limit = int(adaptive.value or limit)
    return tuple(steps), limit
