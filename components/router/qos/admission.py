"""Admission: admit or reject one request from its class and the latency estimate.

Rules, first match wins (reason in quotes)::

    class.may_reject is false                           admit   'always-admit'
    not enable_early_rejection                          admit   'early-rejection-disabled'
    not reject_on_slo_violation                         admit   'slo-rejection-disabled'
    no estimate, or a rate still at its warm-up value   admit   'no-estimate'
      (batch-aware: the TTFT fit; a TPOT fit at warm-up only skips the TPOT rule)
    estimate stale (age_s > estimate_max_age_s)         admit   'stale-estimate'
    est_ttft_ms > limit_ms                              reject  'ttft-slo-risk'
    batch-aware estimate and judged_tpot > tpot_limit   reject  'tpot-slo-risk'
                                                        (held first when holding)
    holding, and the batch beyond the TPOT line's      hold    'tpot-unseen-batch'
      taught batches (``qos.hold``)
    holding, and its prefill would stall an answer      hold    'running-tpot-risk'
      decoding on the worker past its TPOT budget
    otherwise                                           admit   'within-slo'

    limit_ms    = max(class.ttft_ms, est.unloaded_ttft_ms) + low_priority_threshold_ms
    tpot_limit  = max(class.tpot_ms x (1 - hold.tpot_headroom x est.tpot_outlast_share
                                       when holding), est.unloaded_tpot_ms)
    judged_tpot = est_tpot_ms + estimator.tpot_margin_sd x est.tpot_spread_ms

In shadow mode (``QosConfig.mode``) a refusal becomes an admission with
``would_reject`` set and the refusal's reason, and no degradation: the rules run and are
recorded, but nothing is refused, held or changed.

The ``max`` keeps a request from being rejected for its own length: a prompt that misses
the target on an idle system would be rejected on every retry, so such a request is only
rejected when the backlog in front of it adds more than the slack.  Guesses never reject:
warm-up or stale numbers admit, and the reason says why.

``retry_after_s = clamp(ceil((est_ttft_ms - limit_ms) / 1000), 1, 30)``: the queue in
front drains about one millisecond of estimated work per millisecond, so that is when the
same request would first fit again, if nothing else arrived.  A TPOT refusal suggests
1 s: a batch shrinks as soon as one of its requests ends.

When holding, the batch a request joins must leave ``qos.hold.tpot_headroom`` of the
TPOT target free for the part of its answer that outlasts what its estimate sees (the
prefill queued now and the recent prefill window: ``Estimate.tpot_outlast_share``).
Over that part the batch is refilled by prompts placed after it, as its answers end,
and their prefills must fit the budgets ``running-tpot-risk`` protects (which keeps
``running_headroom`` of each back).  A long answer that joins a batch filled to the
exact target leaves no room for them: it misses on every estimate that is short, and
every later prompt is held until answers end.  A short answer ends within what its
estimate already counts (its prefill share is the recent one) and is judged at about
the target.  Measured on long answers at twice the fleet's knee: about 40% fewer
admitted requests over their targets, goodput within the case's spread
(docs/results/heldout.md, "A long answer joins a batch that leaves room").

A TPOT that is only a decode average (``Estimate.tpot_batch == 0``) says nothing about
the batch the request would join, so it never refuses; degradable classes may still be
shortened for it (``adaptive-generation-limit``).

Admitted requests then get their degradation steps (``degrade.plan_degradations``).
"""

from __future__ import annotations

import math

from .classes import QosConfig
from .degrade import plan_degradations
from .types import AdmissionRequest, Estimate, LoadSignals, Verdict

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 30


def retry_after_s(est_ttft_ms: float, limit_ms: float) -> int:
    """Return the Retry-After (whole seconds) for a request over its limit by the excess."""
    excess_s = max(0.0, est_ttft_ms - limit_ms) / 1000.0
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(excess_s)))


def tpot_limit_ms(target_ms: float, estimate: Estimate, config: QosConfig,
                  holding: bool) -> float:
    """The TPOT the batch a request joins may reach: the class's target, less
    ``qos.hold.tpot_headroom`` of it for the share of the answer that outlasts its
    estimate's view when holding; never below the request's own unloaded TPOT (it is not
    refused for its own context)."""
    if holding and config.hold.enabled:
        target_ms *= 1.0 - config.hold.tpot_headroom * estimate.tpot_outlast_share
    return max(target_ms, estimate.unloaded_tpot_ms)


def _rejection_block(estimate: Estimate | None, config: QosConfig) -> str | None:
    """Return why the SLO rule cannot run, or None when it can."""
    if not config.enable_early_rejection:
        return "early-rejection-disabled"
    if not config.reject_on_slo_violation:
        return "slo-rejection-disabled"
    # A batch-aware TTFT stands on its own: a fleet that answers single tokens never
    # learns a TPOT, and its queue must still be judged.
    if estimate is None or estimate.prefill_source == "warmup" or (
            not estimate.tpot_batch and estimate.decode_source == "warmup"):
        return "no-estimate"
    if estimate.stale:
        return "stale-estimate"
    return None


def _unseen_batch(estimate: Estimate | None, config: QosConfig) -> bool:
    """True when the batch the request would join is beyond what its TPOT line was taught
    at (``qos.hold``): only ever a reason to hold, never to refuse."""
    return (estimate is not None and estimate.tpot_batch > 0 and config.hold.enabled
            and config.hold.unseen(estimate.tpot_batch, estimate.tpot_seen_batch))


def _stalls_running(estimate: Estimate, config: QosConfig) -> bool:
    """True when this prompt's prefill would stall an answer decoding on the worker past
    its TPOT budget (``qos.hold``): only ever a reason to hold."""
    stall = estimate.request_tokens * (estimate.stall_per_token_ms
                                       or estimate.prefill_per_token_ms)
    return (config.hold.enabled and estimate.running_slack_ms is not None
            and estimate.prefill_source != "warmup" and stall > estimate.running_slack_ms)


def _refusal(estimate: Estimate, config: QosConfig, limit: float,
             tpot_limit: float | None, holding: bool) -> tuple[str, int] | None:
    """The SLO rules in order, on a usable estimate: (reason, Retry-After) of the first
    that turns the request away, or None."""
    if estimate.est_ttft_ms > limit:
        return "ttft-slo-risk", retry_after_s(estimate.est_ttft_ms, limit)
    if (tpot_limit is not None and estimate.decode_source != "warmup"
            and estimate.est_tpot_ms + config.estimator.tpot_margin_sd
            * estimate.tpot_spread_ms > tpot_limit):
        return "tpot-slo-risk", RETRY_AFTER_MIN_S
    if holding and _unseen_batch(estimate, config):
        return "tpot-unseen-batch", RETRY_AFTER_MIN_S
    if holding and _stalls_running(estimate, config):
        return "running-tpot-risk", RETRY_AFTER_MIN_S
    return None


def admit(request: AdmissionRequest, estimate: Estimate | None, config: QosConfig,
          load: LoadSignals | None = None, holding: bool = False) -> Verdict:
    """Decide one request; called by the router (or frontend) once per request.

    ``request.class_name`` should come from ``resolve_class``; an unknown name is treated as
    ``default_class``.  Returns the verdict with its reason, the Retry-After for a rejection,
    and for an admission the degradation steps and effective ``max_tokens``.

    ``holding``: the caller holds instead of refusing (``qos.hold``, enforce mode): a
    batch beyond what the TPOT line was taught at then answers 'tpot-unseen-batch' (not
    admitted yet) after the TTFT rule, or instead of 'no-estimate' while the TTFT fit
    is still at its warm-up value.  Never in shadow mode.
    """
    holding = holding and config.mode == "enforce"
    load = load or LoadSignals()
    cls = config.class_named(request.class_name) or config.class_named(config.default_class)
    assert cls is not None  # QosConfig guarantees default_class names a class
    judged: dict = {"class_name": cls.name,
                    "est_ttft_ms": estimate.est_ttft_ms if estimate is not None else None}
    if estimate is not None and estimate.tpot_batch > 0:
        judged["est_tpot_ms"] = estimate.est_tpot_ms
    if not cls.may_reject:
        reason = "always-admit"
    elif (blocked := _rejection_block(estimate, config)) is not None:
        if blocked == "no-estimate" and holding and _unseen_batch(estimate, config):
            return Verdict(admit=False, reason="tpot-unseen-batch",
                           retry_after_s=RETRY_AFTER_MIN_S, **judged)
        reason = blocked
    else:
        assert estimate is not None  # _rejection_block returned None
        limit = max(cls.ttft_ms, estimate.unloaded_ttft_ms) + config.low_priority_threshold_ms
        judged["limit_ms"] = limit
        if estimate.tpot_batch > 0:
            judged["tpot_limit_ms"] = tpot_limit_ms(cls.tpot_ms, estimate, config, holding)
        refusal = _refusal(estimate, config, limit, judged.get("tpot_limit_ms"), holding)
        if refusal is not None:
            if config.mode == "shadow":
                return Verdict(admit=True, reason=refusal[0], would_reject=True,
                               max_tokens=request.max_tokens, **judged)
            return Verdict(admit=False, reason=refusal[0], retry_after_s=refusal[1], **judged)
        reason = "within-slo"
    if config.mode == "shadow":
        return Verdict(admit=True, reason=reason, max_tokens=request.max_tokens, **judged)
    steps, max_tokens = plan_degradations(request, cls, estimate, load, config.degradation)
    return Verdict(admit=True, reason=reason, degrade=steps, max_tokens=max_tokens, **judged)


def may_preempt(queued_class: str, incoming_class: str, config: QosConfig) -> bool:
    """Whether incoming work may jump ahead of, or preempt, queued prefill work.

    Called by the prefill queue or scheduler when a request arrives while others wait.
    True iff the incoming class is strictly more important than the queued one and the
    queued class has ``may_reject``: work of a class promised admission is not pushed back
    either.  Unknown names count as ``default_class``.
    """
    queued_rank = config.rank(queued_class)
    queued = config.classes[queued_rank]
    return config.rank(incoming_class) < queued_rank and queued.may_reject
