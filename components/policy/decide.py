"""The watcher's pure core: what to do when ``current`` changes, and what to report.

No I/O: ``PolicyWatcher`` feeds it the pointers it reads from etcd and the outcome of
each apply, and publishes what it returns.  Tests drive it with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from .records import ComponentStatus, CurrentPointer


class StepKind(StrEnum):
    """What the watcher does with a pointer."""

    APPLY = "apply"   # fetch the version and call the component's apply function
    ADOPT = "adopt"   # same content as what runs: record the new number, call nothing
    SKIP = "skip"     # nothing to do


@dataclass(frozen=True)
class Step:
    """The decision for one pointer, with the reason shown in logs and statuses."""

    kind: StepKind
    reason: str


@dataclass(frozen=True)
class WatchState:
    """What one component instance runs and what it last refused."""

    running: int | None = None        # version in effect; None: built-in configuration
    running_sha: str | None = None
    refused: int | None = None        # last version the component could not apply
    refused_reason: str | None = None


def decide(state: WatchState, pointer: CurrentPointer | None) -> Step:
    """Decide what to do with the ``current`` pointer just read or watched (None: unset).

    Called at start, on each watch event and after each reconnect, so the same pointer
    may arrive more than once; only a version newer than what runs triggers an apply,
    and a refused version is not retried until ``current`` moves again.
    """
    if pointer is None:
        keep = f"v{state.running}" if state.running else "the built-in configuration"
        return Step(StepKind.SKIP, f"no policy in etcd; keeping {keep}")
    if pointer.version == state.running:
        return Step(StepKind.SKIP, f"already running v{pointer.version}")
    if pointer.version == state.refused:
        return Step(StepKind.SKIP, f"v{pointer.version} was refused: {state.refused_reason}")
    if state.running is not None and pointer.version < state.running:
        # Versions only grow; an older pointer is a stale read after a reconnect.
        return Step(StepKind.SKIP, f"v{pointer.version} is older than running "
                                   f"v{state.running}")
    if pointer.sha256 == state.running_sha:
        return Step(StepKind.ADOPT, f"v{pointer.version} has the content of running "
                                    f"v{state.running}")
    return Step(StepKind.APPLY, f"new version v{pointer.version}")


def after_attempt(state: WatchState, pointer: CurrentPointer, error: str | None) -> WatchState:
    """Return the state after trying ``pointer`` (``error`` None: applied or adopted).

    A failure leaves ``running`` untouched: the component keeps the previous policy.
    """
    if error is None:
        return WatchState(running=pointer.version, running_sha=pointer.sha256)
    return replace(state, refused=pointer.version, refused_reason=error)


def status_record(state: WatchState, component: str, instance: str, attempted: int | None,
                  error: str | None, now: datetime) -> ComponentStatus:
    """Return the status to publish after an attempt on version ``attempted``."""
    return ComponentStatus(component=component, instance=instance,
                           running_version=state.running, last_version=attempted,
                           ok=error is None, reason=error or "applied", updated_at=now)


def backoff_delay(failures: int, base_s: float = 0.2, cap_s: float = 5.0) -> float:
    """Seconds to wait before reconnect number ``failures`` (1, 2, ...): doubling, capped."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1))
