"""Which answers a local prefill would stall past their TPOT budget.

A prompt prefilled on a decode worker runs in the batch of the answers decoding there:
while it is computed, they get no token.  The disaggregated router's decider says local
on load alone (a long prefill queue, a short prompt); this guard turns such a verdict
into a remote prefill when the stall would push an answer decoding in that batch over
its TPOT budget, and leaves it local when every answer can absorb it (or is lost
already: an answer the work ahead of it overruns is not protected).

The local prefills run first come, first served, one after another (an engine's step
gives its token budget to the waiting prompts before the answers' next tokens), so the
local queue is done at ``free``: the head's start plus every queued prompt's tokens at
``seconds_per_token``.  Per answer in the batch, with ``m`` its ``max_tokens``, ``n``
the tokens it has (at least 1), ``t0`` its first token (for an answer still
prefilling here, when its own prefill is predicted to end), ``s`` its step (its own
mean gap once it has two tokens, at most the last finished answers' mean)::

    base  = (free - t0) + (m - n) * s     # its decode time without the new prompt
    stall = prefill_tokens * seconds_per_token
    protected and harmed iff base <= B * (m - 1) < base + stall

``seconds_per_token`` is learnt from the local prefills themselves (each one's service
time: its first token less the later of its arrival and the previous local prefill's
first token, over its computed tokens; a moving mean); before the first, from the
prefill workers' reports (each handoff's ``compute_s`` over the tokens it computed,
which counts the time a job shares its engine with others: slower than a prompt alone).
With neither the guard abstains (the verdict stands).  ``B`` is the tighter of the
section's ``protect_tpot_ms`` and the answer's own target (its QoS class's ``tpot_ms``,
which the router that placed it passes on); an answer with neither is not protected.
The answer's length is taken at ``max_tokens`` (one that ends
earlier spreads the stall over fewer tokens: optimistic for it), and the whole stall is
charged to it (an engine that gives each step's spare budget to the answers still
emits their tokens during a long prefill, more slowly: pessimistic for long answers).

Which answers share the batch: on one engine (vLLM, SGLang, TensorRT-LLM, torch) every
answer the worker decodes; where the worker fronts a separate engine for local prefills
(the mocker's decode replica, ``EngineCapabilities.local_prefill_own_batch``) only the
answers prefilled here.

Pure bookkeeping: the coordinator calls ``begin``/``token``/``end`` per answer,
``observe_prefill`` per remote handoff and ``judge`` per local verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

SMOOTHING = 0.2
"""Weight of the newest observation in the moving means (prefill speed, decode step)."""
MIN_TOKENS = 64
"""Prefills of fewer computed tokens say more about overheads than speed: not learnt."""
PROTECTS = "protects-decoding"
"""The decision reason of a local verdict the guard sent remote."""


@dataclass
class Answer:
    """One answer on this worker."""

    max_tokens: int
    local: bool
    """Prefilled here (in the local prefills' batch where that batch is its own)."""
    begun_at: float
    prefill_tokens: int = 0
    """For a local prefill: the prompt tokens it computes."""
    tokens: int = 0
    first_at: float | None = None
    """When its first token came (``now``'s clock); None: still prefilling."""
    budget_s: float | None = None
    """Its own TPOT target (its QoS class's), if it carries one."""


@dataclass(frozen=True)
class Judgment:
    """The guard's answer for one local verdict."""

    keep_local: bool
    reason: str
    """'fits', 'protects-decoding', 'no-rate' (nothing learnt yet), 'off' (no budget)."""
    stall_s: float = 0.0
    harmed: int = 0
    """Answers the stall would push over their budget."""


def _tighter(a: float | None, b: float | None) -> float | None:
    """The smaller of two optional targets."""
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else SMOOTHING * new + (1 - SMOOTHING) * old


class StallGuard:
    """One decode worker's answers and what it knows of prefill speed."""

    def __init__(self, *, own_local_batch: bool = False,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.own_local_batch = own_local_batch
        self._now = now
        self._answers: dict[str, Answer] = {}
        self.local_spt: float | None = None
        """Seconds per prompt token of the local prefills, learnt from them."""
        self.remote_spt: float | None = None
        """The same from the prefill workers' reports (the prior)."""
        self.step_s: float | None = None
        self._last_local_done: float | None = None
        self._budgeted = 0  # answers carrying a target of their own

    @property
    def seconds_per_token(self) -> float | None:
        """The prefill speed the guard predicts with (local, else the prior)."""
        return self.local_spt if self.local_spt is not None else self.remote_spt

    # -- what the coordinator reports --------------------------------------------------
    def begin(self, rid: str, max_tokens: int, local: bool, prefill_tokens: int = 0,
              budget_s: float | None = None) -> None:
        """An answer starts (a local one with the prompt tokens it computes here;
        ``budget_s``: its class's TPOT target, if it carries one)."""
        self._answers[rid] = Answer(max_tokens=max_tokens, local=local,
                                    begun_at=self._now(),
                                    prefill_tokens=prefill_tokens if local else 0,
                                    budget_s=budget_s)
        if budget_s is not None:
            self._budgeted += 1

    def token(self, rid: str, count: int) -> None:
        """``count`` tokens of answer ``rid`` arrived."""
        ans = self._answers.get(rid)
        if ans is None:
            return
        if ans.first_at is None:
            now = ans.first_at = self._now()
            if ans.local:
                self._local_done(ans, now)
        ans.tokens += count

    def _local_done(self, ans: Answer, now: float) -> None:
        started = ans.begun_at
        if self._last_local_done is not None:
            started = max(started, self._last_local_done)
        self._last_local_done = now
        if ans.prefill_tokens >= MIN_TOKENS and now > started:
            self.local_spt = _mean(self.local_spt, (now - started) / ans.prefill_tokens)

    def end(self, rid: str) -> None:
        """Answer ``rid`` finished or left; its mean step teaches the decode step."""
        ans = self._answers.pop(rid, None)
        if ans is not None and ans.budget_s is not None:
            self._budgeted -= 1
        if ans is None or ans.first_at is None or ans.tokens < 2:
            return
        self.step_s = _mean(self.step_s, (self._now() - ans.first_at) / (ans.tokens - 1))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill worker computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens >= MIN_TOKENS and seconds > 0:
            self.remote_spt = _mean(self.remote_spt, seconds / tokens)

    # -- the judgment ------------------------------------------------------------------
    def _pending(self, now: float, spt: float) -> tuple[float, dict[str, float]]:
        """When the local prefills queued now are predicted to be done, and when each
        of them is (first come, first served)."""
        queued = sorted((a.begun_at, rid, a.prefill_tokens)
                        for rid, a in self._answers.items()
                        if a.local and a.first_at is None)
        if not queued:
            return now, {}
        at = queued[0][0]
        if self._last_local_done is not None:
            at = max(at, self._last_local_done)
        ends: dict[str, float] = {}
        for _, rid, tokens in queued:
            at += tokens * spt
            ends[rid] = at
        return max(now, at), ends

    def judge(self, prefill_tokens: int, budget_s: float | None) -> Judgment:
        """Whether a local prefill of ``prefill_tokens`` tokens may run in the batch;
        ``budget_s``: the section's ``protect_tpot_ms`` in seconds (None: unset)."""
        if budget_s is None and not self._budgeted:
            return Judgment(True, "off")
        spt = self.seconds_per_token
        if spt is None:
            return Judgment(True, "no-rate")
        now = self._now()
        free, ends = self._pending(now, spt)
        stall = prefill_tokens * spt
        harmed = 0
        for rid, ans in self._answers.items():
            if ans.max_tokens < 2 or (self.own_local_batch and not ans.local):
                continue
            t0 = ans.first_at if ans.first_at is not None else ends.get(rid)
            budget = _tighter(budget_s, ans.budget_s)
            if t0 is None or budget is None:  # prefilled elsewhere and not back yet, or
                continue                      # no target to protect it to
            step = self.step_s or 0.0
            if ans.tokens >= 2 and ans.first_at is not None:
                own = (now - ans.first_at) / (ans.tokens - 1)
                step = min(own, step) if self.step_s is not None else own
            base = max(0.0, free - t0) + max(0, ans.max_tokens - max(ans.tokens, 1)) * step
            allowed = budget * (ans.max_tokens - 1)
            if base <= allowed < base + stall:
                harmed += 1
        if harmed:
            return Judgment(False, PROTECTS, stall, harmed)
        return Judgment(True, "fits", stall)

    def __len__(self) -> int:
        return len(self._answers)
