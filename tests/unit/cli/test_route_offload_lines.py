"""`dynamo route explain`'s lines for the decode worker's offload decision."""

from __future__ import annotations

import pytest

from splitserve.cli.route_cmd import offload_lines

pytestmark = pytest.mark.unit

REQUEST = {"prompt_length": 400, "prefix_cached_length": 0}
SNAPSHOT = {"prefill_queue_depth": 12, "decode_active_requests": 3, "decode_kv_usage": 0.1,
            "live_prefill_workers": 2}


def test_the_rules_contributions_are_listed():
    lines = offload_lines({"request": REQUEST, "snapshot": SNAPSHOT, "decision": {
        "remote": False, "reason": "below-min-score", "score": 0.4,
        "contributions": {"prefill_length": 0.7, "prefill_queue_depth": -0.3}}})
    assert lines[0] == ("offload decision on the decode worker: LOCAL prefill "
                        "(below-min-score, score 0.40)")
    assert "prefill queue 12" in lines[1]
    assert lines[2:] == ["  prefill_length: +0.70", "  prefill_queue_depth: -0.30"]


def test_a_verdict_the_stall_guard_sent_remote_says_what_it_protects():
    lines = offload_lines({"request": REQUEST, "snapshot": SNAPSHOT, "decision": {
        "remote": True, "reason": "protects-decoding", "score": 0.4,
        "contributions": {"prefill_length": 0.7, "prefill_queue_depth": -0.3,
                          "stall_ms": 1200.0, "answers_harmed": 2.0}}})
    assert lines[0].startswith("offload decision on the decode worker: REMOTE prefill "
                               "(protects-decoding")
    assert "  stall_ms: +1200.00" not in lines
    assert lines[-1] == ("  stall guard: prefilling here would stall the batch 1200 ms and "
                         "push 2 answers past their TPOT targets")
