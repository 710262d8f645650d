"""The rule a decode coordinator applies when its engine may not prefill locally."""

from __future__ import annotations

import pytest

from splitserve.components.worker.offload import (
    NO_LOCAL_PREFILL,
    NO_PREFILL_WORKER,
    OffloadPlan,
    plan_after_remote_failure,
    plan_offload,
)

pytestmark = pytest.mark.unit

W = {"max_wait_s": 5.0, "retry_after_s": 2.0, "poll_s": 0.1}

CASES = [
    # remote, reason, supports_local, live, waited -> plan
    (False, "short-prompt", True, 0, 0.0, OffloadPlan("local", "short-prompt")),
    (True, "long-prompt", True, 0, 0.0, OffloadPlan("remote", "long-prompt")),
    (False, "short-prompt", False, 2, 0.0, OffloadPlan("remote", NO_LOCAL_PREFILL)),
    (True, "long-prompt", False, 1, 0.0, OffloadPlan("remote", "long-prompt")),
    (False, "short-prompt", False, 0, 0.0, OffloadPlan("wait", NO_LOCAL_PREFILL, wait_s=0.1)),
    (True, "long-prompt", False, 0, 4.95, OffloadPlan("wait", "long-prompt", wait_s=pytest.approx(0.05))),
    (False, "short-prompt", False, 0, 5.0,
     OffloadPlan("reject", NO_PREFILL_WORKER, retry_after_s=2.0)),
    (True, "long-prompt", False, 0, 9.0,
     OffloadPlan("reject", NO_PREFILL_WORKER, retry_after_s=2.0)),
]


@pytest.mark.parametrize(("remote", "reason", "local", "live", "waited", "want"), CASES)
def test_plan_offload(remote, reason, local, live, waited, want):
    got = plan_offload(remote, reason, supports_local_prefill=local,
                       live_prefill_workers=live, waited_s=waited, **W)
    assert got == want


def test_waiting_always_ends_in_remote_or_reject():
    waited, plan = 0.0, None
    for _ in range(1000):
        plan = plan_offload(False, "x", supports_local_prefill=False, live_prefill_workers=0,
                            waited_s=waited, **W)
        if plan.action != "wait":
            break
        assert plan.wait_s > 0
        waited += plan.wait_s
    assert plan.action == "reject" and waited == pytest.approx(5.0)


@pytest.mark.parametrize(("local", "want"), [
    (True, OffloadPlan("local", "timeout")),
    (False, OffloadPlan("reject", "timeout", retry_after_s=2.0)),
])
def test_after_a_remote_failure(local, want):
    assert plan_after_remote_failure("timeout", supports_local_prefill=local,
                                     retry_after_s=2.0) == want
