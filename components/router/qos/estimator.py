"""Latency estimator: prefill time as fixed + per-token, decode time per token, and the
TTFT/TPOT estimate.

Rates, refreshed on every observation (``smoothing`` = alpha, the weight of the newest
sample; the first sample of a series is taken as is)::

    prefill_ms = prefill_fixed_ms + tokens x prefill_ms_per_token      per worker, per pool
                 (least squares over exponentially weighted samples)
    decode_ms_per_token  = EMA(seconds * 1000 / output tokens generated)  per worker, per pool
    prefill_tokens_mean  = EMA(prompt tokens computed per prefill)        per pool

Why a fixed part: a prefill's time is not proportional to its prompt.  Scheduling, hops
and the forward pass's own floor cost about the same for 4 tokens as for 4,000; divided
per token, a 4-token prompt's 40 ms teaches 10 ms/token, and a 2,000-token prompt is then
"estimated" at 20 s.  The fit keeps that floor in ``prefill_fixed_ms``.  Only when the
recent prompts are all about the same size (their spread under ``FIT_MIN_SPREAD`` of the
mean) is the floor not separable; the fit is then the per-token ratio through the origin,
which for equal sizes is exactly the EMA of seconds per token.  A negative slope or
intercept (noise over a small spread) falls back the same way, or to the least-squares
line through the origin.

A rate is looked up worker -> pool -> warm-up default; ``Estimate.*_source`` says which.

The estimate for a request with ``n`` uncached prompt tokens (the seed's
``prefill_queue_len x avg_prefill_time + decode_queue_len x avg_decode_time``, normalised
per token, plus the request's own work)::

    queued_tokens    = backlog.prefill_queued_tokens
                       or backlog.prefill_queued_requests x prefill_tokens_mean
    prefill_wait_ms  = queued_tokens x prefill_ms_per_token / backlog.prefill_workers
    decode_wait_ms   = backlog.decode_queued_requests x decode_ms_per_token
    queue_wait_ms    = prefill_wait_ms + decode_wait_ms
    unloaded_ttft_ms = prefill_fixed_ms + n x prefill_ms_per_token
                       + decode_ms_per_token          (first_step; see below)
    est_ttft_ms      = queue_wait_ms + unloaded_ttft_ms
    est_tpot_ms      = decode_ms_per_token

Why: the queue is drained by all prefill workers at once, but one prompt is prefilled by
one worker; a decode worker admits waiting requests at step boundaries, so each request
ahead costs about one step, and the request's own first token costs one more when a
decode worker emits it (disaggregated).  An adapter that learns whole TTFTs (prefill and
first token together, aggregated) passes ``first_step=False``: the step is in the fit.
The queued prefills' fixed parts are not added to the wait: the floor is mostly latency
(hops, scheduling), not work that queues.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ConfigDict, Field

from splitserve.contracts.models import StrictModel

from .types import Backlog, Estimate, RateSource

FIT_MIN_SPREAD = 0.1  # std / mean of recent prompt sizes needed to separate the floor


class EstimatorParams(StrictModel):
    """Smoothing factor and the rates assumed before any observation."""

    model_config = ConfigDict(allow_inf_nan=False)

    smoothing: float = Field(default=0.2, gt=0, le=1.0,
                             description="EMA alpha: the weight of the newest sample.")
    warmup_prefill_ms_per_token: float = Field(
        default=0.25, gt=0, description="Prefill rate assumed before any observation "
        "(about 4k prompt tokens/s per worker).")
    warmup_decode_ms_per_token: float = Field(
        default=30.0, gt=0, description="Decode rate assumed before any observation.")
    warmup_prefill_tokens: float = Field(
        default=512.0, gt=0, description="Mean prompt tokens per queued prefill assumed "
        "before any observation (turns a request count into tokens).")
    tpot_margin_sd: float = Field(
        default=0.0, ge=0, le=5, description="Standard deviations of a request's predicted "
        "TPOT spread (the prefill stalls its own decode may meet) added to its predicted "
        "TPOT before the TPOT rule judges it; 0 judges the mean.")


@dataclass
class _Ema:
    """One running average; mutable, owned by one estimator."""

    value: float
    samples: int
    updated_at: float


@dataclass
class _Fit:
    """Exponentially weighted moments of (tokens, ms) for one prefill series."""

    n: float
    t: float
    nn: float
    nt: float
    samples: int
    x_max: float = 0.0  # the largest x (tokens) it has seen

    def update(self, alpha: float, tokens: float, ms: float) -> None:
        self.x_max = max(self.x_max, tokens)
        keep = 1.0 - alpha
        self.n = keep * self.n + alpha * tokens
        self.t = keep * self.t + alpha * ms
        self.nn = keep * self.nn + alpha * tokens * tokens
        self.nt = keep * self.nt + alpha * tokens * ms
        self.samples += 1

    def line(self) -> tuple[float, float]:
        """(fixed ms, ms per token): the weighted least-squares line, constrained to a
        positive slope and a non-negative intercept (module docstring)."""
        ratio = (0.0, self.t / self.n)
        var = self.nn - self.n * self.n
        if var <= (FIT_MIN_SPREAD * self.n) ** 2:
            return ratio
        slope = (self.nt - self.n * self.t) / var
        if slope <= 0:
            return ratio
        fixed = self.t - slope * self.n
        if fixed < 0:
            return 0.0, self.nt / self.nn
        return fixed, slope


@dataclass(frozen=True)
class Rate:
    """A looked-up rate and where it came from; ``fixed_ms`` is the prefill floor (0 for
    decode and for warm-up)."""

    value: float
    source: RateSource
    samples: int
    fixed_ms: float = 0.0


def _per_token_ms(tokens: int, seconds: float) -> float:
    if tokens <= 0:
        raise ValueError(f"an observation needs tokens >= 1, got {tokens}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"an observation needs finite seconds >= 0, got {seconds}")
    return seconds * 1000.0 / tokens


class LatencyEstimator:
    """Holds the EMAs of one router or frontend process; no clock, no I/O, no globals."""

    def __init__(self, params: EstimatorParams | None = None,
                 max_age_s: float = 1.0) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.params = params or EstimatorParams()
        self.max_age_s = max_age_s
        self._emas: dict[tuple[str, str, str], _Ema] = {}
        self._fits: dict[tuple[str, str], _Fit] = {}

    def _update(self, key: tuple[str, str, str], sample: float, now: float) -> None:
        ema = self._emas.get(key)
        if ema is None:
            self._emas[key] = _Ema(sample, 1, now)
            return
        alpha = self.params.smoothing
        ema.value = alpha * sample + (1.0 - alpha) * ema.value
        ema.samples += 1
        ema.updated_at = now

    def _fit(self, key: tuple[str, str], tokens: int, ms: float) -> None:
        fit = self._fits.get(key)
        if fit is None:
            self._fits[key] = _Fit(tokens, ms, tokens * tokens, tokens * ms, 1, tokens)
        else:
            fit.update(self.params.smoothing, tokens, ms)

    def observe_prefill(self, worker: str, pool: str, tokens: int, seconds: float,
                        now: float) -> None:
        """Record one finished prefill of ``tokens`` computed (uncached) prompt tokens.

        Called by the adapter when a prefill completes (the router: when a request's
        first token came, with its TTFT); updates the worker's and the pool's fixed and
        per-token prefill time and the pool's mean prompt size.
        """
        _per_token_ms(tokens, seconds)  # validates
        self._fit(("worker", worker), tokens, seconds * 1000.0)
        self._fit(("pool", pool), tokens, seconds * 1000.0)
        self._update(("prefill-tokens", "pool", pool), float(tokens), now)

    def observe_decode(self, worker: str, pool: str, tokens: int, seconds: float,
                       now: float) -> None:
        """Record ``tokens`` output tokens of one request generated in ``seconds``.

        Called per finished request or per streamed chunk; the sample is that request's
        time per output token, so it already reflects the batch it ran in.
        """
        sample = _per_token_ms(tokens, seconds)
        self._update(("decode", "worker", worker), sample, now)
        self._update(("decode", "pool", pool), sample, now)

    def rate(self, kind: str, pool: str, worker: str | None = None) -> Rate:
        """Return the ms-per-token rate of ``kind`` ('prefill' or 'decode').

        Looks up the worker's series, then the pool's, then the warm-up default; a
        prefill rate carries its fixed part (``Rate.fixed_ms``).
        """
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
        candidates: list[tuple[RateSource, str | None]] = [("worker", worker), ("pool", pool)]
        for source, name in candidates:
            if name is None:
                continue
            if kind == "prefill":
                fit = self._fits.get((source, name))
                if fit is not None:
                    fixed, per_token = fit.line()
                    return Rate(per_token, source, fit.samples, fixed)
                continue
            ema = self._emas.get((kind, source, name))
            if ema is not None:
                return Rate(ema.value, source, ema.samples)
        default = (self.params.warmup_prefill_ms_per_token if kind == "prefill"
                   else self.params.warmup_decode_ms_per_token)
        return Rate(default, "warmup", 0)

    def mean_prefill_tokens(self, pool: str) -> float:
        """Return the pool's mean prompt tokens per prefill, or the warm-up default."""
        ema = self._emas.get(("prefill-tokens", "pool", pool))
        return ema.value if ema is not None else self.params.warmup_prefill_tokens

    def estimate(self, request_tokens: int, backlog: Backlog, now: float, *,
                 prefill_pool: str = "prefill", decode_pool: str = "decode",
                 prefill_worker: str | None = None,
                 decode_worker: str | None = None, first_step: bool = True) -> Estimate:
        """Estimate TTFT and TPOT of a request with ``request_tokens`` uncached prompt tokens.

        Called by admission's adapter once per request, with the backlog it last read;
        returns the estimate with its inputs (formulas in the module docstring).
        ``first_step``: add one decode step for the first token (False when the observed
        prefill times are whole TTFTs, which already hold it).
        """
        if request_tokens < 0:
            raise ValueError(f"request_tokens must be >= 0, got {request_tokens}")
        prefill = self.rate("prefill", prefill_pool, prefill_worker)
        decode = self.rate("decode", decode_pool, decode_worker)
        assumed = backlog.prefill_queued_tokens is None
        queued_tokens = (backlog.prefill_queued_requests * self.mean_prefill_tokens(prefill_pool)
                         if assumed else float(backlog.prefill_queued_tokens or 0))
        prefill_wait = queued_tokens * prefill.value / backlog.prefill_workers
        decode_wait = backlog.decode_queued_requests * decode.value
        unloaded = (prefill.fixed_ms + request_tokens * prefill.value
                    + (decode.value if first_step else 0.0))
        # A backlog stamped slightly after `now` (the adapter read it after taking `now`)
        # is fresh, not an error.
        age = max(0.0, now - backlog.at)
        return Estimate(
            est_ttft_ms=prefill_wait + decode_wait + unloaded, est_tpot_ms=decode.value,
            queue_wait_ms=prefill_wait + decode_wait, unloaded_ttft_ms=unloaded,
            prefill_per_token_ms=prefill.value, prefill_fixed_ms=prefill.fixed_ms,
            decode_per_token_ms=decode.value,
            prefill_source=prefill.source, decode_source=decode.source,
            request_tokens=request_tokens, prefill_queued_tokens=queued_tokens,
            prefill_tokens_assumed=assumed, prefill_workers=backlog.prefill_workers,
            decode_queued_requests=backlog.decode_queued_requests, computed_at=now,
            age_s=age, stale=age > self.max_age_s)

