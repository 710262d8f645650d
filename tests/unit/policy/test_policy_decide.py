"""The watcher's decision core, driven with plain values (no etcd)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from splitserve.components.policy import (
    CurrentPointer,
    StepKind,
    WatchState,
    after_attempt,
    decide,
    status_record,
)
from splitserve.components.policy.decide import backoff_delay

pytestmark = pytest.mark.unit


def ptr(version: int, sha: str | None = None) -> CurrentPointer:
    return CurrentPointer(version=version, sha256=sha or f"sha{version}")


RUNNING_2 = WatchState(running=2, running_sha="sha2")
REFUSED_3 = WatchState(running=2, running_sha="sha2", refused=3, refused_reason="boom")

CASES = {
    "first version at start": (WatchState(), ptr(1), StepKind.APPLY),
    "nothing in etcd at start": (WatchState(), None, StepKind.SKIP),
    "key deleted while running": (RUNNING_2, None, StepKind.SKIP),
    "same version again (reconnect)": (RUNNING_2, ptr(2), StepKind.SKIP),
    "newer version": (RUNNING_2, ptr(3), StepKind.APPLY),
    "stale older pointer": (RUNNING_2, ptr(1), StepKind.SKIP),
    "refused version seen again": (REFUSED_3, ptr(3), StepKind.SKIP),
    "version after a refused one": (REFUSED_3, ptr(4), StepKind.APPLY),
    "rollback to running content": (REFUSED_3, ptr(4, "sha2"), StepKind.ADOPT),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decide(name: str) -> None:
    state, pointer, kind = CASES[name]
    step = decide(state, pointer)
    assert step.kind is kind, step.reason


def test_skip_reasons_say_what_keeps_running() -> None:
    assert "keeping v2" in decide(RUNNING_2, None).reason
    assert "built-in configuration" in decide(WatchState(), None).reason
    assert "boom" in decide(REFUSED_3, ptr(3)).reason


def test_failed_attempt_keeps_the_previous_version() -> None:
    state = after_attempt(RUNNING_2, ptr(3), "ValueError: bad")
    assert (state.running, state.running_sha) == (2, "sha2")
    assert (state.refused, state.refused_reason) == (3, "ValueError: bad")


def test_successful_attempt_clears_the_refusal() -> None:
    assert after_attempt(REFUSED_3, ptr(4), None) == WatchState(running=4, running_sha="sha4")


def test_status_record_reports_running_and_attempted_versions() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    state = after_attempt(RUNNING_2, ptr(3), "ValueError: bad")
    status = status_record(state, "Router", "r0", 3, "ValueError: bad", now)
    assert (status.running_version, status.last_version, status.ok) == (2, 3, False)
    assert status.reason == "ValueError: bad"
    ok = status_record(after_attempt(state, ptr(4), None), "Router", "r0", 4, None, now)
    assert (ok.running_version, ok.ok, ok.reason) == (4, True, "applied")


@pytest.mark.parametrize("failures, delay", [(1, 0.2), (2, 0.4), (3, 0.8), (10, 5.0)])
def test_backoff_doubles_up_to_a_cap(failures: int, delay: float) -> None:
    assert backoff_delay(failures) == pytest.approx(delay)
