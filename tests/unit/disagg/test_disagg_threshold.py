"""The seed's threshold rule, as a decider and as a plain function."""

from __future__ import annotations

import pytest
from splitserve.components.disagg import build_decider, should_offload_prefill
from splitserve.components.disagg.threshold import Params, ThresholdDecider

from .disagg_factories import offload_request, offload_snapshot

pytestmark = pytest.mark.unit

# (prompt, cached, queue, active) -> (remote, reason), default thresholds 256 / 10 / 8 / 64.
CASES = {
    "long prompt, queue has room": ((1000, 0, 3, 0), (True, "prefill-length>=256")),
    "exactly the length threshold": ((256, 0, 0, 0), (True, "prefill-length>=256")),
    "one below the length threshold": ((255, 0, 0, 0), (False, "short-prefill")),
    "prefix hit shortens the prefill": ((1000, 800, 0, 0), (False, "short-prefill")),
    "cache larger than prompt": ((100, 500, 0, 9), (False, "short-prefill")),
    "queue one below max": ((1000, 0, 9, 0), (True, "prefill-length>=256")),
    "queue full": ((1000, 0, 10, 0), (False, "queue-full")),
    "queue full but decode loaded": ((1000, 0, 10, 8), (True, "decode-load")),
    "decode loaded, mid-length": ((64, 0, 0, 8), (True, "decode-load")),
    "decode loaded, too short": ((63, 0, 0, 20), (False, "short-prefill")),
    "decode one below load threshold": ((200, 0, 0, 7), (False, "short-prefill")),
    "decode load counts the prefix hit": ((300, 250, 0, 8), (False, "short-prefill")),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_threshold_rule(case):
    (prompt, cached, queue, active), (remote, reason) = case
    decision = ThresholdDecider(Params()).decide(offload_request(prompt, cached),
                                                 offload_snapshot(queue, active))
    assert (decision.remote, decision.reason) == (remote, reason)
    assert decision.score is None
    assert decision.contributions["prefill_length"] == max(0, prompt - cached)
    assert should_offload_prefill(prompt, cached, queue, active) is remote


@pytest.mark.parametrize(("params", "inputs", "remote"), [
    ({"prefill_length_threshold": 512}, (300, 0, 0, 0), False),
    ({"prefill_length_threshold": 128}, (130, 0, 0, 0), True),
    ({"prefill_queue_max": 2}, (1000, 0, 2, 0), False),
    ({"decode_load_threshold": 2}, (100, 0, 50, 2), True),
    ({"decode_load_min_length": 10}, (10, 0, 0, 8), True),
])
def test_threshold_params(params, inputs, remote):
    prompt, cached, queue, active = inputs
    decider = build_decider({"enable": True, "decider": "threshold", **params})
    got = decider.decide(offload_request(prompt, cached), offload_snapshot(queue, active))
    assert got.remote is remote
    assert should_offload_prefill(prompt, cached, queue, active, **params) is remote


def test_threshold_reason_names_the_configured_length():
    decider = build_decider({"enable": True, "decider": "threshold",
                             "prefill_length_threshold": 300})
    assert decider.decide(offload_request(400), offload_snapshot()).reason == "prefill-length>=300"
