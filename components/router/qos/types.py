"""Inputs and outputs of the QoS core: immutable data, no behaviour beyond derived fields.

Everything here is built by an adapter (router or frontend) from what it observed, passed
to the pure functions in ``estimator``, ``admission`` and ``degrade``, and returned as data
that the adapter turns into HTTP answers, logs and metrics.  Times are in the caller's
clock (seconds, e.g. ``time.monotonic()``); the core never reads a clock.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class FrozenModel(BaseModel):
    """Immutable data with strict keys and no NaN/inf (a NaN would compare false everywhere)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


RateSource = Literal["worker", "pool", "warmup"]
ClassSource = Literal["header", "metadata", "user", "default"]


class ClassResolution(FrozenModel):
    """Which priority class a request belongs to, and why."""

    name: str = Field(description="A class named in the QoS config (never an unknown name).")
    source: ClassSource = Field(description="Where the name came from.")
    reason: str = Field(description="'header', 'metadata', 'user-map', 'default', or "
                        "'unknown-class' when the source named a class the config lacks.")
    requested: str | None = Field(default=None,
                                  description="The raw name the source gave, if any.")


class Backlog(FrozenModel):
    """The work in front of a new request, read by the adapter at time ``at``.

    ``prefill_queued_tokens`` is preferred; when an adapter only knows how many requests
    wait, it leaves it unset and the estimator multiplies the count by its running mean
    of prompt tokens per prefill.
    """

    at: float = Field(description="When the counts were read, in the caller's clock (s).")
    prefill_queued_requests: int = Field(
        default=0, ge=0, description="Requests waiting in the prefill queue (not yet pulled).")
    prefill_queued_tokens: int | None = Field(
        default=None, ge=0, description="Uncached prompt tokens those requests still need "
        "prefilled; None when unknown.")
    prefill_workers: int = Field(
        default=1, ge=1, description="Prefill workers draining the queue in parallel.")
    decode_queued_requests: int = Field(
        default=0, ge=0, description="Requests at the decode worker waiting for their first "
        "decode step (waiting for a batch slot or for their KV).")


class Estimate(FrozenModel):
    """The estimated TTFT and TPOT of one new request, with every input that produced it.

    ``est_ttft_ms = queue_wait_ms + unloaded_ttft_ms`` where ``queue_wait_ms`` is the
    part caused by the backlog and ``unloaded_ttft_ms`` what the request would take on an
    idle system; see ``estimator`` for the formulas.
    """

    est_ttft_ms: float = Field(ge=0, description="Estimated time to first token.")
    est_tpot_ms: float = Field(ge=0, description="Estimated time per output token.")
    queue_wait_ms: float = Field(ge=0, description="Prefill-queue wait + decode-queue wait.")
    unloaded_ttft_ms: float = Field(ge=0, description="Own prefill (fixed + per token), "
                                    "plus one decode step unless the fit holds it.")
    prefill_per_token_ms: float = Field(gt=0, description="Prefill rate used, ms per token.")
    prefill_fixed_ms: float = Field(default=0.0, ge=0, description="Prefill time that does "
                                    "not grow with the prompt (the fit's intercept).")
    decode_per_token_ms: float = Field(gt=0, description="Decode EMA used, ms per token.")
    prefill_source: RateSource = Field(description="Where the prefill rate came from.")
    decode_source: RateSource = Field(description="Where the decode rate came from.")
    request_tokens: int = Field(ge=0, description="This prompt's uncached tokens.")
    prefill_queued_tokens: float = Field(
        ge=0, description="Queued prefill tokens used (given, or requests x mean prompt).")
    prefill_tokens_assumed: bool = Field(
        description="True when prefill_queued_tokens was derived from a request count.")
    prefill_workers: int = Field(ge=1, description="Parallel prefill workers assumed.")
    decode_queued_requests: int = Field(ge=0, description="Decode-queue length used.")
    computed_at: float = Field(description="The ``now`` the estimate was computed at.")
    age_s: float = Field(ge=0, description="now - backlog.at (0 if the backlog is ahead).")
    stale: bool = Field(description="age_s > estimate_max_age_s: the backlog is too old.")
    tpot_batch: int = Field(default=0, ge=0, description="Requests on the worker once this "
                            "one joins, the batch ``est_tpot_ms`` was predicted for; 0 when "
                            "the TPOT is a plain decode average that knows no batch (it "
                            "then never justifies a refusal).")
    unloaded_tpot_ms: float = Field(default=0.0, ge=0, description="Predicted TPOT alone on "
                                    "the worker (batch of one); 0 when not batch-aware.")
    ttft_lag: float = Field(default=1.0, ge=1.0, description="How much later than "
                            "predicted the oldest request still waiting for its first token "
                            "on the worker already is (its age over its prediction, at "
                            "least 1); the TTFT prediction is scaled by it.")
    running_slack_ms: float | None = Field(default=None, description="The least TPOT "
                                           "budget left, in ms, among the answers decoding "
                                           "on the worker that can still meet it (None: "
                                           "none to protect): a prompt whose prefill stalls "
                                           "them longer would push one over (``qos.hold``).")
    stall_per_token_ms: float = Field(default=0.0, ge=0, description="What one prompt "
                                      "token's prefill stalls the answers decoding on the "
                                      "worker, ms (0: ``prefill_per_token_ms``); "
                                      "``running_slack_ms`` is spent at this rate.")
    tpot_seen_batch: int = Field(default=0, ge=0, description="The largest batch the TPOT "
                                 "series behind ``est_tpot_ms`` was taught at (0: none yet): "
                                 "beyond it the line is extrapolated (``qos.hold``).")
    tpot_spread_ms: float = Field(default=0.0, ge=0, description="Standard deviation of the "
                                  "TPOT from the prompts other requests bring to the worker "
                                  "during this one's decode (a short answer meets few, so "
                                  "its TPOT varies most); 0 when unknown.")
    tpot_outlast_share: float = Field(default=0.0, ge=0, le=1, description="The share of "
                                      "the answer's decode that outlasts the prefill queued "
                                      "on the worker now and the recent prefill window: "
                                      "the part of its life in which the batch it joins is "
                                      "refilled by prompts placed after it (0: it ends "
                                      "within what the estimate already sees; 0 when its "
                                      "length is unknown).")
    restore_ms: float = Field(default=0.0, ge=0, description="Part of ``unloaded_ttft_ms``: "
                              "copying the prompt's prefix blocks back from the worker's "
                              "lower KV tiers, at the restore cost the worker measured "
                              "(those blocks are not in ``request_tokens``); the TTFT fit "
                              "is taught without it.")
    waited_ms: float = Field(default=0.0, ge=0, description="How long the client had "
                             "already waited when the request was placed (in the frontend "
                             "before it asked, and held): not in ``est_ttft_ms`` of a "
                             "placed request, which the worker's fits learn from the "
                             "placement on, but in the TTFT its class's target is judged "
                             "on.")
    context_tokens: int = Field(default=0, ge=0, description="The whole prompt, cached or "
                                "not: the KV it holds on its worker while it decodes (0: "
                                "unknown, taken as ``request_tokens``).")

    @property
    def observed(self) -> bool:
        """True when both rates come from measurements, not warm-up defaults."""
        return self.prefill_source != "warmup" and self.decode_source != "warmup"

    @property
    def usable(self) -> bool:
        """True when the estimate may justify a rejection: measured and fresh."""
        return self.observed and not self.stale


class AdmissionRequest(FrozenModel):
    """What admission knows of a request once the frontend has tokenised it."""

    request_id: str = Field(default="", description="For tracing only.")
    class_name: str = Field(description="Resolved priority class (see resolve_class); an "
                            "unknown name is treated as the default class.")
    prompt_tokens: int = Field(ge=0, description="Prompt length in tokens.")
    max_tokens: int = Field(ge=1, description="Generation limit the request asked for "
                            "(or the frontend's default).")


class LoadSignals(FrozenModel):
    """Live load figures the degradation steps compare against their thresholds."""

    prefill_queue_depth: int = Field(default=0, ge=0,
                                     description="Requests waiting in the prefill queue.")
    decode_kv_usage: float = Field(default=0.0, ge=0.0, le=1.0,
                                   description="KV-block usage of the decode pool, 0..1.")


DegradationKind = Literal["cap-max-tokens", "local-prefill", "adaptive-generation-limit"]


class Degradation(FrozenModel):
    """One graceful-degradation step the adapter must apply to an admitted request."""

    kind: DegradationKind = Field(description="Which step.")
    detail: str = Field(description="The condition that fired, e.g. 'kv-usage>=0.85'.")
    value: float | int | None = Field(
        default=None, description="cap-max-tokens / adaptive-generation-limit: the new "
        "max_tokens; local-prefill: the prefill-queue depth that triggered it.")


class Verdict(FrozenModel):
    """Admission's answer for one request."""

    admit: bool = Field(description="False: answer 503 with Retry-After.")
    reason: str = Field(description="Short machine-readable reason (metrics label).")
    class_name: str = Field(description="The class the rules were applied for.")
    retry_after_s: int | None = Field(default=None, ge=1,
                                      description="Rejections only: seconds to suggest.")
    degrade: tuple[Degradation, ...] = Field(default=(), description="Steps to apply, in "
                                             "order; empty for rejections.")
    max_tokens: int | None = Field(default=None, ge=1, description="Admitted: the effective "
                                   "generation limit after degradation.")
    est_ttft_ms: float | None = Field(default=None, description="The estimate compared.")
    limit_ms: float | None = Field(default=None, description="The TTFT limit it was compared "
                                   "against (rejectable classes with a usable estimate).")
    est_tpot_ms: float | None = Field(default=None, description="The TPOT prediction compared "
                                      "(batch-aware estimates only).")
    tpot_limit_ms: float | None = Field(default=None, description="The TPOT limit it was "
                                        "compared against.")
    would_reject: bool = Field(default=False, description="Shadow mode only: admitted although "
                               "the rules refused it; ``reason`` is the refusal's.")

    @property
    def prefill_locally(self) -> bool:
        """True when a 'local-prefill' step asks the decode worker not to offload."""
        return any(step.kind == "local-prefill" for step in self.degrade)
