"""Holding, not only refusing: the ``qos.hold`` section and its rules.

A request that admission would turn away only because of the batch it would join waits
in the router instead (``components/router/hold_queue.py``), deadline-ordered, and is
judged again whenever its workers' state changes (a first token, a TPOT report, a
release) and every ``tick_s``: its wait so far counts in each new TTFT prediction, so
it is placed while it can still meet its targets, or refused as soon as it cannot.

Two verdicts hold (``HOLD_REASONS``):

- ``tpot-slo-risk``: the batch it would join is predicted over the TPOT target (and
  ``tpot_margin_sd`` of spread), less ``tpot_headroom`` of it for the share of a long
  answer that outlasts what its estimate sees: the answers it joins keep room for the
  prompts that will replace the ones that end.  Running answers end and the batch shrinks, so the
  request waits for that instead of being refused at once; its new prompt also stays
  out of the workers while their running answers are near their budget.  When the
  wait reaches ``max_wait_s`` it is refused (``Retry-After`` from the predicted drain).
- ``tpot-unseen-batch``: the batch would grow beyond what the worker's TPOT line was
  ever taught at (more than ``batch_growth`` times its largest taught batch and more
  than ``batch_growth_min`` requests above it).  Beyond that the line is a guess: a
  fleet that has only seen small batches has a flat line, and a surge admitted on it
  forms batches ten times larger that decode ten times slower.  Held requests let the
  batch grow step by step, each step's first answers teaching the line the next (a
  warm burst passes in a fraction of a second, a cold surge is judged on measured
  batches).  A guess never refuses: when such a wait reaches its limit the request is
  placed.

- ``running-tpot-risk``: its prefill (its uncached tokens at the worker's learned rate)
  would stall an answer decoding on the worker for longer than that answer's TPOT budget
  has left after the prefill already queued there, less ``running_headroom`` of it
  (``LatencyPredictor.running_slack_ms``).  A prompt's stall is charged at the TTFT fit's
  rate through the origin when that is above its slope (``stall_per_token``).
  A short answer meets few prompts, so one long prefill can spend most of its budget,
  and a burst of prompts each of which fits it alone spends it many times over; the
  admitted are protected from later arrivals by holding the prompt (or sending it where
  the answers have room) until they end.  An answer the queued prefill already overruns
  is not protected (it misses whatever comes next).  When the wait ends the request is
  refused, not placed: the answers already running were admitted first.

The TTFT rule runs first on every judgement, the wait included: a held request whose
wait and predicted TTFT no longer fit its target is refused then (``ttft-slo-risk``).
Shadow mode, classes that may not reject, explain calls and the slot queue
(``qos.queue.max_inflight_per_worker`` > 0) never hold.
"""

from __future__ import annotations

from pydantic import Field

from splitserve.contracts.models import StrictModel

HOLD_REASONS = {"tpot-slo-risk": "refuse", "tpot-unseen-batch": "place",
                "running-tpot-risk": "refuse"}
"""Verdict reasons a request is held for, and what happens when its wait ends."""


class HoldConfig(StrictModel):
    """The ``qos.hold`` section (on by default)."""

    enabled: bool = Field(default=True, description="Hold requests refused for the batch "
                          "they would join (TPOT) instead of refusing them at once.")
    max_held: int = Field(default=1024, ge=1, description="Requests held at most; the "
                          "next is judged as if holding were off.")
    max_wait_s: float = Field(default=3.0, gt=0, le=30, description="Longest hold; keep it "
                              "below the frontend's route timeout.")
    tick_s: float = Field(default=0.02, gt=0, le=1, description="How often held requests "
                          "are judged again when nothing else changed.")
    running_headroom: float = Field(default=0.2, ge=0, lt=1, description="Share of a "
                                    "running answer's TPOT budget that new prompts' "
                                    "prefills may not spend ('running-tpot-risk'): the "
                                    "prefill and step costs are estimates, and answers "
                                    "filled to their exact budget miss on every estimate "
                                    "that falls short.")
    tpot_headroom: float = Field(default=0.2, ge=0, lt=1, description="Share of the "
                                 "TPOT target the batch a new request joins must leave "
                                 "free ('tpot-slo-risk' while holding), scaled by the "
                                 "share of its answer that outlasts what its estimate "
                                 "sees: room for the prompts that replace the batch's "
                                 "answers as they end. At 0 a long answer's batch fills "
                                 "to the target and every later prompt waits for its "
                                 "answers to end ('running-tpot-risk').")
    batch_growth: float = Field(default=2.0, ge=1, description="A batch may grow to this "
                                "times the largest batch its TPOT line was taught at ...")
    batch_growth_min: int = Field(default=4, ge=1, description="... or by this many "
                                  "requests above it, whichever is more; beyond, the "
                                  "request is held ('tpot-unseen-batch').")

    def unseen(self, batch: int, seen: int) -> bool:
        """True when a batch of ``batch`` is beyond what a line taught up to ``seen``
        may be trusted for."""
        return batch > max(self.batch_growth * seen, seen + self.batch_growth_min)
