"""Decider ``threshold``: the seed's fixed rule.

::

    eff_len = max(0, prompt_length - prefix_cached_length)
    remote if eff_len >= prefill_length_threshold and prefill_queue_depth < prefill_queue_max
    remote if decode_active_requests >= decode_load_threshold and eff_len >= decode_load_min_length
    else local

The second rule deliberately ignores the queue: a saturated decode worker gains more from
shedding a prefill than it loses by waiting in a long queue.  Reasons: remote
'prefill-length>=N' or 'decode-load'; local 'queue-full' (long enough, but the queue is
full and the decode worker is not loaded) or 'short-prefill'.
"""

from __future__ import annotations

from pydantic import Field

from splitserve.contracts.models import StrictModel

from .types import OffloadDecision, OffloadRequest, OffloadSnapshot

TYPE_NAME = "threshold"


class Params(StrictModel):
    """The three thresholds of the seed's rule, plus the decode-load rule's minimum length."""

    prefill_length_threshold: int = Field(
        default=256, ge=1, description="Offload prompts needing at least this many prefill "
        "tokens (after the prefix-cache hit) while the prefill queue has room.")
    prefill_queue_max: int = Field(
        default=10, ge=0, description="The queue has room while its depth is below this.")
    decode_load_threshold: int = Field(
        default=8, ge=1, description="With at least this many active decode requests, "
        "offload even mid-length prompts.")
    decode_load_min_length: int = Field(
        default=64, ge=0, description="Minimum prefill tokens for the decode-load rule.")


def threshold_rule(prefill_length: int, prefill_queue_depth: int,
                   decode_active_requests: int, params: Params) -> tuple[bool, str]:
    """Apply the rule to already-derived inputs; returns (remote, reason)."""
    long_enough = prefill_length >= params.prefill_length_threshold
    if long_enough and prefill_queue_depth < params.prefill_queue_max:
        return True, f"prefill-length>={params.prefill_length_threshold}"
    if (decode_active_requests >= params.decode_load_threshold
            and prefill_length >= params.decode_load_min_length):
        return True, "decode-load"
    return False, "queue-full" if long_enough else "short-prefill"


def should_offload_prefill(prompt_length: int, prefix_cached_length: int,
                           prefill_queue_size: int, decode_active_reqs: int, *,
                           prefill_length_threshold: int = 256, prefill_queue_max: int = 10,
                           decode_load_threshold: int = 8,
                           decode_load_min_length: int = 64) -> bool:
    """The seed's function form, for callers without the typed inputs; True means remote."""
    params = Params(prefill_length_threshold=prefill_length_threshold,
                    prefill_queue_max=prefill_queue_max,
                    decode_load_threshold=decode_load_threshold,
                    decode_load_min_length=decode_load_min_length)
    remote, _ = threshold_rule(max(0, prompt_length - prefix_cached_length),
                               prefill_queue_size, decode_active_reqs, params)
    return remote


class ThresholdDecider:
    """The seed's rule as a decider; contributions carry the three values it compared."""

    def __init__(self, params: Params) -> None:
        self._params = params

    def decide(self, request: OffloadRequest, snapshot: OffloadSnapshot) -> OffloadDecision:
        """Called per request; returns remote or local with the rule that decided."""
        remote, reason = threshold_rule(request.prefill_length, snapshot.prefill_queue_depth,
                                        snapshot.decode_active_requests, self._params)
        return OffloadDecision(remote=remote, reason=reason, contributions={
            "prefill_length": float(request.prefill_length),
            "prefill_queue_depth": float(snapshot.prefill_queue_depth),
            "decode_active_requests": float(snapshot.decode_active_requests),
        })
