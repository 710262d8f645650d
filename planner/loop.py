"""The live loop around the core: observe -> decide -> apply -> record, every interval.

The planner component builds a ``Planner`` from a source, a connector and the policy,
then awaits ``run(stop)`` (or calls ``tick`` from its own loop).  Nothing here decides:
``decide`` does, so the simulator, which calls ``decide`` with its own observations,
makes the same decisions as this loop for the same observations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from .config import PlannerPolicy
from .connectors.base import ApplyResult, Connector
from .core import decide
from .metrics import PlannerMetrics
from .model import Decision, Move, Observation, PlannerState, Scale

log = logging.getLogger(__name__)


class ObservationSource(Protocol):
    """Anything that can produce an observation for time ``now``."""

    async def observe(self, now: float) -> Observation:
        """One round of readings, stamped ``now``."""
        ...


def describe(decision: Decision) -> list[str]:
    """One log line per action: what, why, and the data behind it."""
    lines = []
    for a in decision.actions:
        if isinstance(a, Move):
            what = f"move {a.count} {a.source}->{a.dest} ({a.source_target}/{a.dest_target})"
            lines.append(f"{what} [{a.reason}] {a.detail}")
        elif isinstance(a, Scale):
            lines.append(f"{a.pool} {a.delta:+d} -> {a.target} [{a.reason}] {a.detail}")
        else:
            lines.append(f"{a.pool} hold [{a.reason}] {a.detail}")
    return lines


class Planner:
    """Holds the policy and the core's state between intervals."""

    def __init__(self, policy: PlannerPolicy, source: ObservationSource, connector: Connector,
                 metrics: PlannerMetrics | None = None, state: PlannerState | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.source = source
        self.connector = connector
        self.metrics = metrics or PlannerMetrics()
        self.state = state or PlannerState()
        self.clock = clock
        self.last: tuple[Observation, Decision, list[ApplyResult]] | None = None

    def set_policy(self, policy: PlannerPolicy) -> None:
        """Take a new policy (hot reload); streaks, cooldowns and history carry over."""
        self.policy = policy

    async def tick(self, now: float | None = None) -> Decision:
        """One interval: observe, decide, apply the changes, log and export; returns the
        decision.  The state advances even when applying fails: the next observation
        shows what the fleet really runs, and cooldowns keep a failing call from being
        retried every interval."""
        when = self.clock() if now is None else now
        observation = await self.source.observe(when)
        decision = decide(observation, self.policy, self.state)
        results = await self.connector.apply(decision.changes())
        self.state = decision.state
        self.metrics.record(decision, observation)
        for r in results:
            if not r.ok:
                self.metrics.failed(r.pool)
        for line in describe(decision):
            log.info("planner: %s", line)
        self.last = (observation, decision, results)
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``planner.interval_s`` until ``stop`` is set; a failed tick (e.g.
        the supervisor restarting) is logged and the loop goes on."""
        while not stop.is_set():
            started = self.clock()
            try:
                await self.tick(started)
            except Exception as exc:  # noqa: BLE001 - keep planning through outages
                log.warning("planner: interval failed: %s", exc)
            wait = max(0.0, self.policy.planner.interval_s - (self.clock() - started))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
