"""The connector protocol, the shared apply loop, and the dry-run connector."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..model import Action, Move, Scale

log = logging.getLogger(__name__)

# Component names of the disaggregated graphs (graphs/disagg*.py).
DEFAULT_COMPONENTS: Mapping[str, str] = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}


@dataclass(frozen=True)
class ApplyResult:
    """One replica target sent to the fleet: which pool, how many, and whether it took."""

    pool: str
    replicas: int
    ok: bool
    detail: str = ""


class Connector(Protocol):
    """What the planner loop calls after ``decide``."""

    async def apply(self, actions: Sequence[Action]) -> list[ApplyResult]:
        """Apply the changes among ``actions`` in order; one result per replica target."""
        ...

    async def close(self) -> None:
        """Release clients; called once when the planner stops."""
        ...


def replica_steps(actions: Sequence[Action]) -> list[tuple[str, int, str]]:
    """``(pool, target, reason)`` in apply order: a move shrinks its source first, so
    the retasked GPUs are free before the other pool claims them."""
    steps = []
    for a in actions:
        if isinstance(a, Move):
            steps += [(a.source, a.source_target, a.reason), (a.dest, a.dest_target, a.reason)]
        elif isinstance(a, Scale):
            steps.append((a.pool, a.target, a.reason))
    return steps


class ReplicaConnector:
    """Base for connectors that set an absolute replica count per pool.

    Subclasses implement ``set_replicas``; a failure is reported in the result (and the
    remaining steps still run) so one unreachable pool does not freeze the other.
    """

    async def set_replicas(self, pool: str, replicas: int) -> str:
        """Ask the fleet for ``replicas`` of ``pool``; returns a detail line, raises on error."""
        raise NotImplementedError

    async def apply(self, actions: Sequence[Action]) -> list[ApplyResult]:
        results = []
        for pool, target, reason in replica_steps(actions):
            try:
                detail = await self.set_replicas(pool, target)
                results.append(ApplyResult(pool, target, True, detail))
                log.info("planner: %s -> %d replicas (%s)", pool, target, reason)
            except Exception as exc:  # noqa: BLE001 - report per step, keep going
                results.append(ApplyResult(pool, target, False, str(exc)))
                log.warning("planner: could not set %s to %d: %s", pool, target, exc)
        return results

    async def close(self) -> None:
        return None


class DryRunConnector(ReplicaConnector):
    """Logs what it would do; ``applied`` keeps the targets for tests and the CLI."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, int]] = []

    async def set_replicas(self, pool: str, replicas: int) -> str:
        self.applied.append((pool, replicas))
        return "dry run: not applied"
