"""Latency estimator: per-token EMAs of prefill and decode time, and the TTFT/TPOT estimate.

Rates, refreshed on every observation (``smoothing`` = alpha, the weight of the newest
sample; the first sample of a series is taken as is)::

    prefill_ms_per_token = EMA(seconds * 1000 / prompt tokens computed)   per worker, per pool
    decode_ms_per_token  = EMA(seconds * 1000 / output tokens generated)  per worker, per pool
    prefill_tokens_mean  = EMA(prompt tokens computed per prefill)        per pool

A rate is looked up worker -> pool -> warm-up default; ``Estimate.*_source`` says which.

The estimate for a request with ``n`` uncached prompt tokens (the seed's
``prefill_queue_len x avg_prefill_time + decode_queue_len x avg_decode_time``, normalised
per token, plus the request's own work)::

    queued_tokens    = backlog.prefill_queued_tokens
                       or backlog.prefill_queued_requests x prefill_tokens_mean
    prefill_wait_ms  = queued_tokens x prefill_ms_per_token / backlog.prefill_workers
    decode_wait_ms   = backlog.decode_queued_requests x decode_ms_per_token
    queue_wait_ms    = prefill_wait_ms + decode_wait_ms
    unloaded_ttft_ms = n x prefill_ms_per_token + decode_ms_per_token
    est_ttft_ms      = queue_wait_ms + unloaded_ttft_ms
    est_tpot_ms      = decode_ms_per_token

Why: the queue is drained by all prefill workers at once, but one prompt is prefilled by
one worker; a decode worker admits waiting requests at step boundaries, so each request
ahead costs about one step, and the request's own first token costs one more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ConfigDict, Field

from splitserve.common.models import StrictModel

from .types import Backlog, Estimate, RateSource


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


@dataclass
class _Ema:
    """One running average; mutable, owned by one estimator."""

    value: float
    samples: int
    updated_at: float


@dataclass(frozen=True)
class Rate:
    """A looked-up rate and where it came from."""

    value: float
    source: RateSource
    samples: int


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

    def _update(self, key: tuple[str, str, str], sample: float, now: float) -> None:
        ema = self._emas.get(key)
        if ema is None:
            self._emas[key] = _Ema(sample, 1, now)
            return
        alpha = self.params.smoothing
        ema.value = alpha * sample + (1.0 - alpha) * ema.value
        ema.samples += 1
        ema.updated_at = now

    def observe_prefill(self, worker: str, pool: str, tokens: int, seconds: float,
                        now: float) -> None:
        """Record one finished prefill of ``tokens`` computed (uncached) prompt tokens.

        Called by the adapter when a prefill completes; updates the worker's and the
        pool's per-token rate and the pool's mean prompt size.
        """
        sample = _per_token_ms(tokens, seconds)
        self._update(("prefill", "worker", worker), sample, now)
        self._update(("prefill", "pool", pool), sample, now)
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

        Looks up the worker's EMA, then the pool's, then the warm-up default.
        """
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
        candidates: list[tuple[RateSource, str | None]] = [("worker", worker), ("pool", pool)]
        for source, name in candidates:
            ema = self._emas.get((kind, source, name)) if name is not None else None
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
                 decode_worker: str | None = None) -> Estimate:
        """Estimate TTFT and TPOT of a request with ``request_tokens`` uncached prompt tokens.

        Called by admission's adapter once per request, with the backlog it last read;
        returns the estimate with its inputs (formulas in the module docstring).
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
        unloaded = request_tokens * prefill.value + decode.value
        # A backlog stamped slightly after `now` (the adapter read it after taking `now`)
        # is fresh, not an error.
        age = max(0.0, now - backlog.at)
        return Estimate(
            est_ttft_ms=prefill_wait + decode_wait + unloaded, est_tpot_ms=decode.value,
            queue_wait_ms=prefill_wait + decode_wait, unloaded_ttft_ms=unloaded,
            prefill_per_token_ms=prefill.value, decode_per_token_ms=decode.value,
            prefill_source=prefill.source, decode_source=decode.source,
            request_tokens=request_tokens, prefill_queued_tokens=queued_tokens,
            prefill_tokens_assumed=assumed, prefill_workers=backlog.prefill_workers,
            decode_queued_requests=backlog.decode_queued_requests, computed_at=now,
            age_s=age, stale=age > self.max_age_s)

