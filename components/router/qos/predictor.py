"""Per-worker latency prediction: TTFT from the queue ahead on the worker, TPOT from the
KV the batch the request joins holds; learned from every finished request, loaded or not.

For one request with ``n`` uncached prompt tokens on worker ``w`` (after ``w``'s prefix
hit), at time ``now``::

    ahead      = uncached prompt tokens of the requests placed on w that have not
                 produced a first token (reported by the frontend) or finished
    est_ttft   = (fixed + (ahead + n) x per_token) x lag          (TTFT fit of w)
    lag        = how late w's oldest request still without a first token already is
                 (its age over its prediction, at least 1: ``lag``)
    kv         = prompt tokens (cached or not) of the requests placed on w and not
                 released, + its own                              (the batch it joins)
    busy       = the share of recent time w had prompt work ahead  (EMA, ``BUSY_WINDOW_S``);
                 for an answer that outlasts the queue ahead, partly the long-run share
                 (``BUSY_LONG_WINDOW_S``), never more than the recent one (``_answer_busy``)
    est_tpot   = (base + per_kv x kv / KV_UNIT) / (1 - busy)      (TPOT fit of w)

Both are lines learned per worker and for the pool, from every request, loaded or not:

- TTFT: ``x = ahead + n`` at placement, ``y`` = the measured time from placement to
  first token, a weighted least-squares line (``estimator._Fit``).  Queued and unqueued
  requests both teach it, so the slope is the worker's *effective* drain rate: an
  engine that runs one sequence at a time serves a request's tokens only once the
  request ahead has decoded, and the slope says so; an engine with a large batch
  overlaps them, and the slope is smaller.  No unloaded-only filter and no bootstrap are
  needed.  ``ahead`` counts what was placed and has neither shown a first token
  (``first_token``, reported by the frontend: a call when it routes in process, a
  batched report to a Router process) nor been released.  It is never a queue drained
  at the learned rate: that queue's length would depend on the fit it teaches (a slope
  too low drains it too fast, the samples then show long TTFTs behind short queues, the
  slope swings up, and back); on a shared machine it oscillated.
- TPOT: ``x`` = the mean KV the worker's batch held over the request's life so far
  (the integral of ``kv`` over time, divided by the time, in ``KV_UNIT`` tokens), ``y``
  = its measured time per output token, taught once per request: after its first
  output tokens (``decode_progress``, in the frontend) or at its release.  A decode step
  reads every running sequence's KV, so it follows the tokens the batch holds, not the
  number of requests in it (one mocker worker: 9 ms a step for 48 answers on 256-token
  prompts, 30 ms for 48 on 6,000-token prompts); a line on the count, taught while
  contexts were short, read a batch of long ones at a third of its cost.  Samples are
  kept per KV size (geometric bins ``BIN_RATIO`` wide, an EMA of the time and of ``x``
  each) and the line is fitted over those bins, each weighted by its samples (at most
  ``BIN_WEIGHT_CAP``): a fleet that ran full for minutes still remembers what a light
  batch cost, so the slope does not fade under steady load as one EMA over all samples
  would.  With one bin (or a slope <= 0) the line is flat, the mean TPOT: no evidence of
  growth is no growth, never a guess that would refuse.  The largest batch (in
  requests) taught is kept beside it, for the hold rule's "beyond what was taught".
  The tokens an answer has decoded are not counted (a few percent of the context where
  prompts are long).

- The answers' measured pace: the frontend reports each answer's progress every few
  tokens (``decode_progress``), and each report gives its stall-free step over the
  tokens since the one before.  A new request's step is never predicted below the
  median of those of the answers decoding on the worker now, plus what its own context
  adds on the line, and a running answer's remaining tokens are charged at its own pace
  when that is slower than the line (``running_slack_ms``).  The line is taught on the
  loads a fleet has run at: what decodes slower per token as the load grows (an engine
  past its sweet spot, or a frontend near the end of its stream rate) shows in the pace
  at once and in the line only after its first samples at that load.

- Prefill stalls: an engine that prefills a long prompt pauses its running decodes (or
  shares the step with them), so a worker that is prefilling a share ``busy`` of the time
  decodes ``1 / (1 - busy)`` slower.  The fit is taught the stall-free step (the measured
  TPOT times ``1 - busy`` over that request's decode) and the prediction divides it by the
  worker's recent ``busy``.  Without this a burst of long prompts is admitted up to the
  TTFT target, the queue of prefills then keeps every running stream stalled, and the
  admitted miss their TPOT (measured: TPOT p50 129 ms against a 50 ms target).  ``busy``
  is measured where the frontend reports first tokens: without them a request is
  "ahead" until its release and the share would read 1.

A TTFT fit is not trusted for prompts far longer than it has seen: when a request's own
``n`` is more than ``EXTRAPOLATION`` times the largest ``ahead + n`` it was taught, its
source reads ``warmup`` (admission answers ``no-estimate``: admitted) until requests of
that size have taught it.  A fleet's first requests are short (health checks, warm-up),
and a line through them alone (their fixed cost read as a cost per token) said 8k-token
prompts on an idle worker would take seconds: the first long prompts of a run were
refused at 0.5x capacity.  The work ahead is not limited so: once the fit knows what a
token costs, a queue of many prompts is that many times the cost, and a burst must be
judged while it builds up, before its first answers could teach anything.

A series is used once it holds ``MIN_SAMPLES`` samples (worker, else pool); before that
its source is ``warmup`` and admission answers ``no-estimate`` instead of refusing.

Pure: the adapter passes ``now`` and each request's timings; the predictor keeps one
ticket per placed request until its ``finish`` and returns a ``Calibration`` (predicted
against measured) for the adapter's metrics.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .estimator import EstimatorParams, _Fit
from .types import Estimate, RateSource

MIN_SAMPLES = 3
BIN_WEIGHT_CAP = 8  # samples that count for a TPOT bin's weight in the line
MAX_TICKETS = 100_000  # placed requests remembered until their release (bounds memory)
EXTRAPOLATION = 2.0  # a TTFT fit judges x up to this times the largest x it has seen
BUSY_WINDOW_S = 0.5  # time constant of the prefill-busy share
BUSY_LONG_WINDOW_S = 10.0  # ... of its long-run share, what a long answer meets (``predict``)
MAX_BUSY = 0.9  # a worker busier than this predicts (and teaches) as if 0.9
STALL_SMOOTHING = 0.1  # EMA weight of the newest placed prompt's prefill time
STALL_SAMPLE_MIN_TOKENS = 256  # prompt tokens prefilled beside an answer to measure a stall
KV_UNIT = 1024.0  # context tokens per unit of the TPOT line's x
BIN_RATIO = 1.25  # the TPOT line's bins: x within this ratio of each other share one
LAG_SLACK_MS = 250.0  # lateness below this (network, a step) is no evidence (``lag``)
MAX_LAG = 100.0
PACE_MAX_AGE_S = 2.0  # an answer's measured pace counts this long after its last report


@dataclass
class _Bins:
    """TPOT samples per KV size (``x`` in ``KV_UNIT`` tokens, geometric bins ``BIN_RATIO``
    wide): an EMA of the time, a sample count and an EMA of ``x`` per bin; the line over
    them is computed again only after a new sample."""

    bins: dict[int, list[float]] = field(default_factory=dict)  # key -> [ema, samples, x]
    samples: int = 0
    batch_seen: int = 0  # the largest mean batch (requests) taught
    cached: tuple[float, float] | None = None
    dirty: bool = True

    def update(self, alpha: float, x: float, ms: float, batch: float = 1.0) -> None:
        x = max(x, 1e-3)
        key = round(math.log(x) / math.log(BIN_RATIO))
        cell = self.bins.get(key)
        if cell is None:
            self.bins[key] = [ms, 1.0, x]
        else:
            cell[0] = alpha * ms + (1.0 - alpha) * cell[0]
            cell[1] += 1.0
            cell[2] = alpha * x + (1.0 - alpha) * cell[2]
        self.samples += 1
        self.batch_seen = max(self.batch_seen, round(batch))
        self.dirty = True

    def seen(self) -> int:
        """The largest batch taught (0 before any sample)."""
        return self.batch_seen

    def line(self) -> tuple[float, float] | None:
        """(base, slope) over the bins, or None before MIN_SAMPLES (``_line``)."""
        if self.dirty:
            self.cached, self.dirty = self._line(), False
        return self.cached

    def _line(self) -> tuple[float, float] | None:
        """(base, slope) over the bins, or None before MIN_SAMPLES; flat without growth."""
        if self.samples < MIN_SAMPLES:
            return None
        pts = [(x, ema, min(n, BIN_WEIGHT_CAP)) for ema, n, x in self.bins.values()]
        total = sum(w for _, _, w in pts)
        my = sum(y * w for _, y, w in pts) / total
        if len(pts) < 2:  # (exactly flat: rounding would make a slope of the noise)
            return my, 0.0
        mx = sum(b * w for b, _, w in pts) / total
        var = sum(w * (b - mx) ** 2 for b, _, w in pts)
        slope = sum(w * (b - mx) * (y - my) for b, y, w in pts) / var if var > 0 else 0.0
        if slope <= 0:
            return my, 0.0
        base = my - slope * mx
        if base < 0:  # steeper than proportional: the line through the origin
            return 0.0, sum(w * b * y for b, y, w in pts) / sum(w * b * b for b, _, w in pts)
        return base, slope


@dataclass
class _Worker:
    """One worker's running count (and its time integral) and its prefill queue."""

    running: int = 0
    area: float = 0.0  # integral of ``running`` over time, request-seconds
    kv: float = 0.0  # context tokens of the placed requests not released
    kv_area: float = 0.0  # integral of ``kv / KV_UNIT`` over time
    at: float = 0.0
    inflight_tokens: float = 0.0  # uncached prompt tokens of placed requests not released
    pending_tokens: float = 0.0  # ... of those whose first token was not reported yet
    decoding: dict[str, Ticket] = field(default_factory=dict)
    """Placed requests past their first token with a TPOT budget (``place``'s
    ``tpot_budget_ms``), until their release."""
    waiting: OrderedDict[str, Ticket] = field(default_factory=OrderedDict)
    """The tickets of placed requests whose first token was not reported yet, oldest
    placement first (without the frontend's first-token reports a request leaves at
    its release)."""
    ttft: _Fit | None = None
    tpot: _Bins = field(default_factory=_Bins)
    busy_area: float = 0.0  # integral of [prompt work ahead] over time, seconds
    busy: float = 0.0  # its recent share (EMA over BUSY_WINDOW_S)
    busy_long: float = 0.0  # its long-run share (EMA over BUSY_LONG_WINDOW_S)
    stall_ms: float = 0.0  # EMA of the predicted prefill time of prompts placed here
    prefilled: float = 0.0  # prompt tokens whose first token was reported, ever
    stall_excess_ms: float = 0.0  # EMA of answers' decode time beyond the stall-free step
    stall_tokens: float = 0.0  # ... and of the prompt tokens prefilled during it

    def advance(self, now: float) -> None:
        if now > self.at:
            dt = now - self.at
            self.area += self.running * dt
            self.kv_area += self.kv / KV_UNIT * dt
            ahead = 1.0 if self.pending_tokens > 0 else 0.0
            self.busy_area += ahead * dt
            keep = math.exp(-dt / BUSY_WINDOW_S)
            self.busy = keep * self.busy + (1.0 - keep) * ahead
            keep = math.exp(-dt / BUSY_LONG_WINDOW_S)
            self.busy_long = keep * self.busy_long + (1.0 - keep) * ahead
            self.at = now


@dataclass(frozen=True)
class Ticket:
    """What was predicted for a placed request, kept until it finishes."""

    worker: str
    class_name: str
    placed_at: float
    x_ttft: float  # ahead + own tokens
    area_at: float
    ahead_requests: int  # placed requests on the worker still without a first token
    estimate: Estimate
    would_reject: bool
    max_tokens: int = 0  # the answer's length limit (0: unknown)
    tpot_budget_ms: float = 0.0  # its class's TPOT target (0: none to protect)
    kv_area_at: float = 0.0


@dataclass(frozen=True)
class Calibration:
    """One finished request: its prediction against what was measured."""

    class_name: str
    worker: str
    would_reject: bool
    ttft_observed: bool  # the TTFT prediction came from a learned fit, not warm-up values
    tpot_observed: bool
    predicted_ttft_ms: float
    measured_ttft_ms: float
    predicted_tpot_ms: float
    measured_tpot_ms: float | None  # None for a single output token
    mean_batch: float
    waited_ms: float = 0.0  # before its placement (frontend, held): in the client's TTFT


def _recent_share(queued_ms: float, life_ms: float) -> float:
    """The share of an answer's decode (``life_ms``) spent while the prompts queued ahead
    of it now drain, or within the recent prefill window (``BUSY_WINDOW_S``) if longer:
    the part its estimate's recent prefill share already sees."""
    return min(1.0, max(BUSY_WINDOW_S * 1000.0, queued_ms) / life_ms)


def _kv_of(estimate: Estimate) -> float:
    """The KV a placed request holds on its worker: its whole prompt (its uncached
    tokens where the caller gave no context)."""
    return max(estimate.context_tokens, estimate.request_tokens)


def _ttft_line(fit: _Fit | None) -> tuple[float, float] | None:
    """(fixed, per token) of a TTFT series with enough samples, else None."""
    if fit is None or fit.samples < MIN_SAMPLES:
        return None
    return fit.line()


class LatencyPredictor:
    """Per-worker TTFT and TPOT prediction for one router or frontend process."""

    def __init__(self, params: EstimatorParams | None = None) -> None:
        self.params = params or EstimatorParams()
        self.workers: dict[str, _Worker] = {}
        self.pool = _Worker()
        self.tickets: OrderedDict[str, Ticket] = OrderedDict()
        self.service_ms: float | None = None  # EMA of placement-to-release times
        self.first_tokens: dict[str, float] = {}  # request -> measured TTFT (ms)
        self.decode_seen: set[str] = set()  # requests whose TPOT taught the fit already
        self.at_first: dict[str, tuple[float, float, float]] = {}
        """rid -> (time, its worker's ``busy_area``, its worker's ``prefilled``) at its
        first token."""
        self.progress: dict[str, tuple[int, float, float, float]] = {}
        """rid -> (output tokens streamed, time, its worker's ``busy_area``, its measured
        stall-free step in ms over the interval since the report before) at its latest
        ``decode_progress``: an answer's measured pace (``_measured_step``)."""
        self.first_tokens_reported = False
        self.trace: Callable[[dict], None] | None = None
        """Diagnostics: called with each first token's prediction against its measure
        (with the worker's queue, busy share and fits then) and each finished request's
        (TPOT predicted and measured, the batch, the slack it was judged on)."""
        self._slack_at = -math.inf
        self._slack: dict[tuple[str, float, float], float | None] = {}
        """``running_slack_ms`` per (worker, prefill rate) at ``_slack_at``: a walk over
        the worker's tickets, asked for every candidate of every held request at each
        re-judgement; dropped by anything that changes a ticket or a fit."""

    def _worker(self, worker: str, now: float) -> _Worker:
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = _Worker(at=now)
        w.advance(now)
        return w

    def _series(self, w: _Worker, kind: str) -> tuple[tuple[float, float] | None, RateSource]:
        sources: tuple[tuple[RateSource, _Worker], ...] = (("worker", w), ("pool", self.pool))
        for source, holder in sources:
            line = _ttft_line(holder.ttft) if kind == "ttft" else holder.tpot.line()
            if line is not None:
                return line, source
        return None, "warmup"

    def ttft_line(self, worker: str, now: float) -> tuple[float, float, RateSource]:
        """(fixed ms, ms per token, source) of the worker's TTFT fit."""
        line, source = self._series(self._worker(worker, now), "ttft")
        fixed, per_token = line or (0.0, self.params.warmup_prefill_ms_per_token)
        return fixed, max(per_token, 1e-6), source

    def stall_per_token(self, worker: str, now: float) -> float:
        """What a prompt token's prefill stalls the answers decoding on ``worker``, ms:
        the TTFT line's slope, or its rate through the origin when that is higher.  The
        slope alone is no bound: a line fitted over a burst's queues can trade its slope
        for its intercept, and a prompt's stall is then charged at a fraction of what it
        costs."""
        _, per_token, source = self.ttft_line(worker, now)
        return self._stall_rate(worker, per_token, source)

    def _stall_rate(self, worker: str, per_token: float, source: RateSource) -> float:
        """``stall_per_token`` from the line ``ttft_line`` gave (slope and source)."""
        fit = self._ttft_fit(worker, source) if source != "warmup" else None
        origin = fit.nt / fit.nn if fit is not None and fit.nn > 0 else 0.0
        return max(per_token, origin)

    def _ttft_fit(self, worker: str, source: RateSource) -> _Fit | None:
        """The TTFT series ``source`` of ``worker`` (the pool's, or the worker's)."""
        holder = self.pool if source == "pool" else self.workers.get(worker)
        return holder.ttft if holder is not None else None

    def _seen(self, worker: str, source: RateSource) -> float:
        """The largest x the TTFT series ``source`` of ``worker`` was taught."""
        fit = self._ttft_fit(worker, source)
        return fit.x_max if fit is not None else 0.0

    def tpot_line(self, worker: str, now: float) -> tuple[float, float, RateSource]:
        """(base ms, ms per ``KV_UNIT`` tokens the batch holds, source) of the worker's
        TPOT fit."""
        line, source = self._series(self._worker(worker, now), "tpot")
        base, slope = line or (self.params.warmup_decode_ms_per_token, 0.0)
        return base, slope, source

    def tpot_seen(self, worker: str, source: RateSource) -> int:
        """The largest batch the TPOT series ``source`` of ``worker`` was taught at; for
        warm-up values, the largest any of the worker's or the pool's samples ran at."""
        w = self.workers.get(worker)
        if source == "pool":
            return self.pool.tpot.seen()
        if source == "worker":
            return w.tpot.seen() if w is not None else 0
        return max(self.pool.tpot.seen(), w.tpot.seen() if w is not None else 0)

    def completion_rate(self) -> float | None:
        """Requests the fleet finishes per second now (running requests over the mean
        placement-to-release time); None before any release."""
        if not self.service_ms:
            return None
        return sum(w.running for w in self.workers.values()) * 1000.0 / self.service_ms

    def tpot_drain_s(self, worker: str, limit_ms: float, now: float) -> float | None:
        """Seconds until enough of ``worker``'s running requests end for a new one to be
        predicted within ``limit_ms`` of TPOT: the requests over the KV the line allows
        (at the worker's mean KV per running request), each ending after a mean
        placement-to-release time shared by the batch; None when unknown."""
        base, slope, source = self.tpot_line(worker, now)
        w = self._worker(worker, now)
        if source == "warmup" or slope <= 0 or not self.service_ms or w.running == 0:
            return None
        busy = min(MAX_BUSY, w.busy) if self.first_tokens_reported else 0.0
        fits = (limit_ms * (1.0 - busy) - base) / slope  # the largest load within
        per = w.kv / KV_UNIT / w.running  # one running request's load
        over = (w.kv / KV_UNIT + per - max(per, fits)) / max(per, 1e-9)
        return max(0.0, over) * self.service_ms / 1000.0 / w.running

    def load(self, worker: str) -> tuple[float, int]:
        """(prompt tokens ahead, requests running) on ``worker``: cheap, for ordering."""
        w = self.workers.get(worker)
        return (w.pending_tokens, w.running) if w is not None else (0.0, 0)

    def pool_rates(self) -> tuple[float, float]:
        """(TTFT ms per token, TPOT ms of a batch holding ``KV_UNIT`` tokens) of the pool's
        fits, for gauges."""
        ttft = _ttft_line(self.pool.ttft)
        tpot = self.pool.tpot.line()
        per_token = ttft[1] if ttft else self.params.warmup_prefill_ms_per_token
        one = tpot[0] + tpot[1] if tpot else self.params.warmup_decode_ms_per_token
        return per_token, one

    def lag(self, worker: str, now: float, class_name: str | None = None) -> float:
        """How much later than predicted the worker's oldest request still waiting for
        its first token (of ``class_name``, when given) already is: its age over its
        predicted TTFT plus ``LAG_SLACK_MS``, at least 1 and at most ``MAX_LAG``.

        A request that has not answered is a sample the fits cannot learn from yet (its
        TTFT is only known to exceed its age): when the queue ahead costs more than the
        fits say, for whatever reason (prefix credit for KV that is gone by the time the
        request runs, work the token count does not see), nothing teaches them until the
        late requests answer, and everything placed meanwhile is predicted from the same
        wrong line.  Under FIFO a request waits for the ones placed before it, so the
        oldest one's lateness is a lower bound of how wrong the line is right now."""
        w = self.workers.get(worker)
        if w is None or not self.first_tokens_reported:
            return 1.0
        for ticket in w.waiting.values():
            if class_name is not None and ticket.class_name != class_name:
                continue
            late = (now - ticket.placed_at) * 1000.0 / (ticket.estimate.est_ttft_ms
                                                       + LAG_SLACK_MS)
            return min(MAX_LAG, max(1.0, late))
        return 1.0

    def running_slack_ms(self, worker: str, now: float, per_token_ms: float = 0.0,
                         headroom: float = 0.0) -> float | None:
        """The least TPOT budget left among ``worker``'s answers that can still meet
        theirs, once the prefill already queued there has run: what a new prompt's
        prefill may still spend of it.  Each answer's budget is its target times its
        length, assumed to run to ``max_tokens`` (an upper bound: a limit far above the
        answer only makes the budget looser).

        - An answer decoding now: less the time it has decoded, what its remaining
          tokens take at the worker's stall-free step (at its own measured pace when
          that is slower), and every prompt queued on the worker (``per_token_ms`` a
          token), all prefilled before a new one.  Its progress is the tokens it was
          last reported at (``decode_progress``), then the time since that the worker
          had no prompt to prefill, at that step; until its release at least one token
          is left.  (An estimate from the recent busy share read a stalled answer as
          done and dropped its protection exactly while prompts were stalling it.)
        - An answer still waiting for its first token: less its whole answer at the
          stall-free step and the prompts placed after it, which are prefilled while it
          decodes.

        Each admitted prompt is judged alone, so without the queued prompts a burst of
        prompts each of which fits an answer's budget would together spend it many times
        over.  An answer the queued prefill (or the time already spent) overruns is lost
        whatever comes next and is not protected.  Of an answer still protected,
        ``headroom`` of its budget is kept back (``qos.hold.running_headroom``): the
        prefill and step costs are estimates, and answers filled to their exact budget
        miss on every estimate that is short.  None when no answer can still be."""
        w = self.workers.get(worker)
        if w is None or not (w.decoding or w.waiting):
            return None
        if now != self._slack_at:
            self._slack.clear()
            self._slack_at = now
        key = (worker, per_token_ms, headroom)
        if key not in self._slack:
            self._slack[key] = self._running_slack(w, worker, now, per_token_ms, headroom)
        return self._slack[key]

    def _running_slack(self, w: _Worker, worker: str, now: float, per_token_ms: float,
                       headroom: float) -> float | None:
        base, slope, _ = self.tpot_line(worker, now)  # (advances ``w`` to ``now``)
        step = max(1e-3, base + slope * w.kv / KV_UNIT)
        per_token = max(0.0, per_token_ms)
        ahead_ms = w.pending_tokens * per_token
        kept: list[float] = []  # what each answer still protected leaves, less headroom
        for rid, ticket in w.decoding.items():
            first_ms = self.first_tokens.get(rid)
            if first_ms is None:
                continue
            elapsed = (now - ticket.placed_at) * 1000.0 - first_ms
            tokens = ticket.max_tokens - 1
            # Its progress: the tokens it was last reported at (none before a report),
            # then the time since that the worker had no prompt to prefill, at the
            # stall-free step: the line's, or the answer's own measured one when slower
            # (the stalls to come are the prompts charged here); until its release at
            # least one token is left.
            pace = self.progress.get(rid)
            own = step
            if pace is not None:
                done, since, busy_at = pace[0] - 1, pace[1], pace[2]
                if now - since <= PACE_MAX_AGE_S:
                    own = max(step, pace[3])
            else:
                start = self.at_first.get(rid)
                done, since = 0, now - elapsed / 1000.0
                busy_at = start[1] if start is not None else w.busy_area
            stalled = (w.busy_area - busy_at) * 1000.0
            run_ms = max(0.0, (now - since) * 1000.0 - stalled)
            remaining = max(1.0, tokens - done - run_ms / own)
            left = ticket.tpot_budget_ms * tokens - elapsed - remaining * own - ahead_ms
            if left >= 0:
                kept.append(left - headroom * ticket.tpot_budget_ms * tokens)
        behind = 0.0  # prompt tokens placed after the ticket, newest first
        for ticket in reversed(w.waiting.values()):
            tokens = ticket.max_tokens - 1
            if ticket.tpot_budget_ms > 0 and tokens > 0:
                left = (ticket.tpot_budget_ms - step) * tokens - behind * per_token
                if left >= 0:
                    kept.append(left - headroom * ticket.tpot_budget_ms * tokens)
            behind += ticket.estimate.request_tokens
        return min(kept, default=None)

    def predict(self, worker: str, own_tokens: int, now: float,
                held_ms: float = 0.0, output_tokens: int = 0,
                class_name: str | None = None, running_slack: bool = False,
                restore_ms: float = 0.0, headroom: float = 0.0,
                context_tokens: int = 0) -> Estimate:
        """Predict a request with ``own_tokens`` uncached prompt tokens placed on
        ``worker`` now; called by admission for each candidate worker.  ``held_ms``: the
        time it will wait before being placed (an admission queue ahead of it);
        ``output_tokens``: the answer's length it asks for (its ``max_tokens``), which sets
        how many other prompts its decode may meet (``tpot_spread_ms``);
        ``running_slack``: also find the running answers' least TPOT budget left
        (``running_slack_ms``, a walk over them; only a holding caller reads it);
        ``restore_ms``: what copying its prefix blocks back from the worker's lower KV
        tiers takes there, as the worker measured it (those blocks are not in
        ``own_tokens``): part of its own time to first token; ``context_tokens``: its
        whole prompt, cached or not (0: ``own_tokens``)."""
        own = max(0, own_tokens)
        fixed, per_token, ttft_source = self.ttft_line(worker, now)
        stall_rate = self._stall_rate(worker, per_token, ttft_source)
        base, slope, tpot_source = self.tpot_line(worker, now)
        w = self._worker(worker, now)
        ahead = w.pending_tokens
        batch = w.running + 1
        context = max(own, context_tokens)
        if ttft_source != "warmup" and own > EXTRAPOLATION * self._seen(worker, ttft_source):
            ttft_source = "warmup"  # a prompt beyond what the fit has seen: a guess
        lag = self.lag(worker, now, class_name) if ttft_source != "warmup" else 1.0
        restore = max(0.0, restore_ms)
        own_ms = fixed + own * per_token + restore
        # Late first tokens scale the whole line (the queue and this prompt alike); only
        # the queue's part carries it, so the SLO limit (at least ``own_ms``) is not
        # raised by it.
        queue_ms = (own_ms + ahead * per_token) * lag - own_ms + max(0.0, held_ms)
        # The batch it joins decodes no faster than its answers were just measured to,
        # plus what its own context adds: a line taught on lighter loads can be far
        # below that (an engine, or a frontend, slower per token as the load grows).
        step = max(1e-3, base + slope * (w.kv + context) / KV_UNIT,
                   self._measured_step(w, now) + slope * context / KV_UNIT)
        queued_ms = ahead * per_token * lag
        busy = self._answer_busy(w, step, output_tokens, queued_ms)
        tpot = step / (1.0 - busy)
        outlast = 0.0
        if output_tokens >= 2:
            outlast = 1.0 - _recent_share(queued_ms, (output_tokens - 1) * tpot)
        spread = 0.0
        if output_tokens >= 2 and busy > 0 and w.stall_ms > 0:
            spread = math.sqrt(busy * tpot * w.stall_ms / (output_tokens - 1))
        return Estimate(
            est_ttft_ms=queue_ms + own_ms, est_tpot_ms=tpot, queue_wait_ms=queue_ms,
            unloaded_ttft_ms=own_ms, prefill_per_token_ms=per_token, prefill_fixed_ms=fixed,
            decode_per_token_ms=tpot, prefill_source=ttft_source, decode_source=tpot_source,
            request_tokens=own, prefill_queued_tokens=ahead, prefill_tokens_assumed=False,
            prefill_workers=1, decode_queued_requests=w.running, computed_at=now, age_s=0.0,
            stale=False, tpot_batch=batch,
            unloaded_tpot_ms=max(1e-3, base + slope * context / KV_UNIT),
            ttft_lag=lag, tpot_seen_batch=self.tpot_seen(worker, tpot_source),
            running_slack_ms=self.running_slack_ms(worker, now, stall_rate, headroom)
            if running_slack else None, stall_per_token_ms=stall_rate,
            tpot_spread_ms=spread, restore_ms=restore, tpot_outlast_share=outlast,
            context_tokens=context)

    def _answer_busy(self, w: _Worker, step: float, output_tokens: int,
                     queued_ms: float) -> float:
        """The share of an answer's decode the worker will spend prefilling prompts.

        The recent share (``BUSY_WINDOW_S``) is what an answer meets while the prompts
        queued now drain, and all it meets if it ends within that time.  An answer that
        outlasts it (``output_tokens`` at the step it would decode at under the long-run
        share) meets the long-run share (``BUSY_LONG_WINDOW_S``) for the rest: a burst of
        prompts that stalls the batch for a second stalls a ten-second answer for a tenth
        of its life.  The long-run share only ever lowers the recent one: after a burst
        it still counts prompts that have stopped arriving."""
        if not self.first_tokens_reported:
            return 0.0
        busy = min(MAX_BUSY, w.busy)
        longer = min(MAX_BUSY, w.busy_long)
        if output_tokens < 2 or longer >= busy:
            return busy
        recent = _recent_share(queued_ms, (output_tokens - 1) * step / (1.0 - longer))
        return recent * busy + (1.0 - recent) * longer

    def place(self, request_id: str, worker: str, estimate: Estimate, now: float, *,
              class_name: str, would_reject: bool = False, max_tokens: int = 0,
              tpot_budget_ms: float = 0.0) -> None:
        """Called once the request is placed on ``worker`` with ``estimate`` (from
        ``predict`` at the same ``now``): it joins the batch and the prefill queue.
        ``max_tokens`` and ``tpot_budget_ms`` (its class's TPOT target): its answer's
        budget, which later prompts' prefills must leave room for
        (``running_slack_ms``); 0 leaves it unprotected."""
        self._slack.clear()
        if self.trace is not None:
            self.trace({"event": "place", "request": request_id, "worker": worker, "at": now,
                        "own": estimate.request_tokens, "context": estimate.context_tokens,
                        "restore_ms": estimate.restore_ms, "waited_ms": estimate.waited_ms,
                        "queue_wait_ms": estimate.queue_wait_ms, "class": class_name,
                        "would_reject": would_reject, "max_tokens": max_tokens,
                        "tpot_budget_ms": tpot_budget_ms})
        old = self.tickets.pop(request_id, None)
        if old is not None:  # placed again (migrated) before its release: move its load
            self._drop(old, now, request_id)
        w = self._worker(worker, now)
        w.running += 1
        w.kv += _kv_of(estimate)
        stall = estimate.request_tokens * estimate.prefill_per_token_ms
        w.stall_ms = stall if w.stall_ms == 0 else \
            STALL_SMOOTHING * stall + (1.0 - STALL_SMOOTHING) * w.stall_ms
        w.inflight_tokens += estimate.request_tokens
        w.pending_tokens += estimate.request_tokens
        ticket = self.tickets[request_id] = Ticket(
            worker, class_name, now, estimate.prefill_queued_tokens
            + max(1, estimate.request_tokens), w.area, len(w.waiting), estimate,
            would_reject, max_tokens, tpot_budget_ms, w.kv_area)
        w.waiting[request_id] = ticket
        while len(self.tickets) > MAX_TICKETS:
            rid, old = self.tickets.popitem(last=False)
            self._drop(old, now, rid)

    def first_token(self, request_id: str, now: float) -> None:
        """Called when a placed request's first token reached the frontend (reported by
        it: a call in process, a batched report to a Router process): its prompt leaves
        the work ahead of later requests, and its TTFT teaches the fit at once instead
        of at its release."""
        self._slack.clear()
        ticket = self.tickets.get(request_id)
        if ticket is None or request_id in self.first_tokens:
            return
        ttft_ms = max(0.0, now - ticket.placed_at) * 1000.0
        self.first_tokens[request_id] = ttft_ms
        self.first_tokens_reported = True
        w = self._worker(ticket.worker, now)
        w.pending_tokens = max(0.0, w.pending_tokens - ticket.estimate.request_tokens)
        w.waiting.pop(request_id, None)
        if ticket.max_tokens > 1 and ticket.tpot_budget_ms > 0:
            w.decoding[request_id] = ticket
        w.prefilled += ticket.estimate.request_tokens
        self.at_first[request_id] = (now, w.busy_area, w.prefilled)
        if self.trace is not None:
            self.trace({"event": "first_token", "request": request_id, "worker": ticket.worker,
                        "at": now, "placed_at": ticket.placed_at, "own": ticket.estimate
                        .request_tokens, "ahead": ticket.estimate.prefill_queued_tokens,
                        "ahead_requests": ticket.ahead_requests,
                        "predicted_ms": ticket.estimate.est_ttft_ms,
                        "source": ticket.estimate.prefill_source, "measured_ms": ttft_ms,
                        "pending_after": w.pending_tokens, "busy": w.busy,
                        "busy_long": w.busy_long,
                        "running": w.running, "line": self.tpot_line(ticket.worker, now)[:2],
                        "per_token": self.ttft_line(ticket.worker, now)[1]})
        self._learn_ttft(w, ticket.x_ttft, max(0.0, ttft_ms - ticket.estimate.restore_ms))

    def decode_progress(self, request_id: str, tokens: int, now: float) -> None:
        """Called as a request streams, every few output tokens (the frontend reports
        it; its first token came with ``first_token``).  The first report teaches the
        TPOT fit at once with its TPOT so far, against the mean KV of the batch it ran
        in so far (a long answer otherwise teaches only at its end, and a fleet filling
        up under load for the first time would be admitted blind for that long); each
        gives its measured pace."""
        self._slack.clear()
        if self.trace is not None:
            self.trace({"event": "progress", "request": request_id, "tokens": tokens,
                        "at": now})
        ticket = self.tickets.get(request_id)
        first_ms = self.first_tokens.get(request_id)
        if ticket is None or first_ms is None or tokens < 2:
            return
        self._note_pace(request_id, tokens, now)
        if request_id in self.decode_seen:
            return
        decode_s = now - ticket.placed_at - first_ms / 1000.0
        span = now - ticket.placed_at
        if decode_s <= 0 or span <= 0:
            return
        self.decode_seen.add(request_id)
        w = self._worker(ticket.worker, now)
        mean_batch = max(1.0, (w.area - ticket.area_at) / span)
        mean_load = (w.kv_area - ticket.kv_area_at) / span
        tpot_ms = self._stall_free(self.at_first.get(request_id), w, now,
                                   decode_s * 1000.0 / (tokens - 1))
        for holder in (w, self.pool):
            holder.tpot.update(self.params.smoothing, mean_load, tpot_ms, mean_batch)

    def _note_pace(self, request_id: str, tokens: int, now: float) -> None:
        """Keep an answer's latest progress report and its stall-free step since the
        report before (since its first token for the first report)."""
        last = self.progress.get(request_id)
        if last is None:
            start = self.at_first.get(request_id)
            if start is None:
                return
            last = (1, start[0], start[1], 0.0)
        n, at, busy_at, _ = last
        if tokens <= n or now <= at:
            return
        w = self._worker(self.tickets[request_id].worker, now)
        busy = min(MAX_BUSY, max(0.0, (w.busy_area - busy_at) / (now - at)))
        step = (now - at) * 1000.0 / (tokens - n) * (1.0 - busy)
        self.progress[request_id] = (tokens, now, w.busy_area, step)

    def _measured_step(self, w: _Worker, now: float) -> float:
        """The median stall-free step the answers decoding on ``w`` were measured at over
        their latest reported tokens (``PACE_MAX_AGE_S`` old at most; 0 without one)."""
        steps = sorted(p[3] for rid in w.decoding
                       if (p := self.progress.get(rid)) is not None
                       and now - p[1] <= PACE_MAX_AGE_S)
        return steps[len(steps) // 2] if steps else 0.0

    @staticmethod
    def _stall_free(start: tuple[float, float, float] | None, w: _Worker, now: float,
                    tpot_ms: float) -> float:
        """``tpot_ms`` measured since a request's first token (``start``: its time and the
        worker's busy integral then, ``at_first``), without the share of that time the
        worker spent on prompts ahead (see the module docstring)."""
        if start is None or now <= start[0]:
            return tpot_ms
        busy = min(MAX_BUSY, max(0.0, (w.busy_area - start[1]) / (now - start[0])))
        return tpot_ms * (1.0 - busy)

    def _learn_stall(self, w: _Worker, worker: str, now: float, tpot_ms: float,
                     output_tokens: int, mean_load: float,
                     prefilled: float) -> tuple[float, float] | None:
        """Measure what prompts stalled a finished answer: its decode time beyond the
        stall-free step of the TPOT line at its mean KV, against the prompt tokens
        whose first token came while it decoded on its worker (at least
        ``STALL_SAMPLE_MIN_TOKENS``).  Both are smoothed and their ratio is
        ``measured_stall_per_token`` (calibration only: a prompt is still charged at
        ``stall_per_token``).  Returns (excess ms, prompt tokens), or None when the
        answer is no sample."""
        if prefilled < STALL_SAMPLE_MIN_TOKENS:
            return None
        base, slope, source = self.tpot_line(worker, now)
        if source == "warmup":
            return None
        steps = output_tokens - 1
        excess = (tpot_ms - (base + slope * mean_load)) * steps
        alpha = self.params.smoothing
        for holder in (w, self.pool):
            if holder.stall_tokens == 0.0:
                holder.stall_excess_ms, holder.stall_tokens = excess, prefilled
            else:
                holder.stall_excess_ms = alpha * excess + (1.0 - alpha) * holder.stall_excess_ms
                holder.stall_tokens = alpha * prefilled + (1.0 - alpha) * holder.stall_tokens
        return excess, prefilled

    def measured_stall_per_token(self, worker: str | None = None) -> float | None:
        """What a prompt token's prefill was measured to stall the answers decoding
        beside it, ms (``_learn_stall``), on ``worker`` (None: the pool); None before a
        sample.  Set against ``stall_per_token``, what admission charges."""
        holder = self.pool if worker is None else self.workers.get(worker)
        if holder is None or holder.stall_tokens <= 0.0:
            return None
        return max(0.0, holder.stall_excess_ms / holder.stall_tokens)

    def _learn_ttft(self, w: _Worker, x: float, ttft_ms: float) -> None:
        for holder in (w, self.pool):
            if holder.ttft is None:
                holder.ttft = _Fit(x, ttft_ms, x * x, x * ttft_ms, 1, x)
            else:
                holder.ttft.update(self.params.smoothing, x, ttft_ms)

    def _drop(self, ticket: Ticket, now: float, rid: str) -> _Worker:
        self._slack.clear()
        self.decode_seen.discard(rid)
        self.at_first.pop(rid, None)
        self.progress.pop(rid, None)
        w = self._worker(ticket.worker, now)
        w.decoding.pop(rid, None)
        if self.first_tokens.pop(rid, None) is None:
            w.pending_tokens = max(0.0, w.pending_tokens - ticket.estimate.request_tokens)
            w.waiting.pop(rid, None)
        w.running = max(0, w.running - 1)
        w.kv = max(0.0, w.kv - _kv_of(ticket.estimate))
        w.inflight_tokens = max(0.0, w.inflight_tokens - ticket.estimate.request_tokens)
        w.pending_tokens = min(w.pending_tokens, w.inflight_tokens)
        return w

    def expire(self, now: float, ttl_s: float) -> None:
        """Forget placements older than ``ttl_s`` (a release that never came)."""
        while self.tickets:
            rid, ticket = next(iter(self.tickets.items()))
            if now - ticket.placed_at <= ttl_s:
                return
            del self.tickets[rid]
            self._drop(ticket, now, rid)

    def finish(self, request_id: str, now: float, *, ok: bool, ttft_s: float | None,
               duration_s: float | None, output_tokens: int) -> Calibration | None:
        """Called when a placed request is over, with the frontend's timings (measured
        from the placement it reported: ``ttft_s`` to the first token, ``duration_s`` to
        the end).  Learns from a finished request and returns its calibration; None for
        one not placed here, one that failed or one with no first token."""
        self._slack.clear()
        if self.trace is not None:
            self.trace({"event": "release", "request": request_id, "at": now, "ok": ok,
                        "ttft_s": ttft_s, "duration_s": duration_s,
                        "output_tokens": output_tokens})
        ticket = self.tickets.pop(request_id, None)
        if ticket is None:
            return None
        reported = self.first_tokens.get(request_id)
        decode_taught = request_id in self.decode_seen
        start = self.at_first.get(request_id)
        self.decode_seen.discard(request_id)
        w = self._drop(ticket, now, request_id)
        if not ok or ttft_s is None:
            return None
        # The frontend measured from the reply it got; the prediction is from the
        # placement here.  With the end time known, the first token's time on this
        # clock is (now - duration + ttft); the difference is the route reply's trip.
        first = now - duration_s + ttft_s if duration_s is not None else ticket.placed_at
        ttft_ms = max(ttft_s, first - ticket.placed_at) * 1000.0
        if reported is not None:  # measured on this clock already, and learned from
            ttft_ms = reported
        tpot_ms = None
        if output_tokens > 1 and duration_s is not None:
            tpot_ms = max(0.0, duration_s - ttft_s) * 1000.0 / (output_tokens - 1)
        span = now - ticket.placed_at
        alpha = self.params.smoothing
        self.service_ms = span * 1000.0 if self.service_ms is None else \
            alpha * span * 1000.0 + (1.0 - alpha) * self.service_ms
        mean_batch = (w.area - ticket.area_at) / span if span > 0 else w.running + 1.0
        mean_batch = max(1.0, mean_batch)
        mean_load = (w.kv_area - ticket.kv_area_at) / span if span > 0 else \
            (w.kv + _kv_of(ticket.estimate)) / KV_UNIT
        if reported is None:
            self._learn_ttft(w, ticket.x_ttft, max(0.0, ttft_ms - ticket.estimate.restore_ms))
        measured = tpot_ms is not None and math.isfinite(tpot_ms)
        stall = None
        if measured and start is not None:
            stall = self._learn_stall(w, ticket.worker, now, tpot_ms, output_tokens,
                                      mean_load, w.prefilled - start[2])
        if measured and not decode_taught:
            clean = self._stall_free(start, w, now, tpot_ms)
            for holder in (w, self.pool):
                holder.tpot.update(alpha, mean_load, clean, mean_batch)
        est = ticket.estimate
        if self.trace is not None:
            self.trace({"event": "finish", "request": request_id, "worker": ticket.worker,
                        "at": now, "placed_at": ticket.placed_at, "own": est.request_tokens,
                        "ttft_ms": ttft_ms, "predicted_ttft_ms": est.est_ttft_ms,
                        "waited_ms": est.waited_ms,
                        "tpot_ms": tpot_ms, "predicted_tpot_ms": est.est_tpot_ms,
                        "batch_at_place": est.tpot_batch, "mean_batch": mean_batch,
                        "output_tokens": output_tokens, "max_tokens": ticket.max_tokens,
                        "slack_ms": est.running_slack_ms, "spread_ms": est.tpot_spread_ms,
                        "would_reject": ticket.would_reject, "stall": stall,
                        "busy_decode": None if start is None or now <= start[0] else
                        (w.busy_area - start[1]) / (now - start[0])})
        return Calibration(ticket.class_name, ticket.worker, ticket.would_reject,
                           est.prefill_source != "warmup", est.decode_source != "warmup",
                           est.est_ttft_ms, ttft_ms, est.est_tpot_ms, tpot_ms,
                           mean_batch, est.waited_ms)
