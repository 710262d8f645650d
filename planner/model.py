"""Plain data the planner core reads and returns: observations, state, actions, decisions.

Frozen dataclasses rather than pydantic models: they are built every interval (and
thousands of times by the simulator), never read from a file, and compare by value,
which is what the "simulator and live planner decide alike" test relies on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

# Pool names: actions and diagnostics carry them as plain strings from this tuple.
POOLS: tuple[str, ...] = ("prefill", "decode")
SIGNALS = ("queue_length", "gpu_utilization", "kv_cache_usage")


@dataclass(frozen=True)
class PoolObservation:
    """One pool at one moment, in the units of the seed's ``autoscale`` thresholds.

    ``replicas``: live replicas (ready and starting) — what the connector set, as seen.
    ``queue_length``: waiting requests per ready replica.  ``gpu_utilization`` and
    ``kv_cache_usage``: percent (0..100), averaged over ready replicas.  None: no reading.
    """

    replicas: int
    queue_length: float | None = None
    gpu_utilization: float | None = None
    kv_cache_usage: float | None = None
    ready: int | None = None

    def signal(self, name: str) -> float | None:
        """The reading of a threshold signal by its policy name, or None when unread."""
        return getattr(self, name)


@dataclass(frozen=True)
class Observation:
    """Everything the core sees in one interval; ``time_s`` is the caller's clock.

    The rates and latencies are over the interval that just ended, for SLA mode:
    ``ttft_s`` and ``itl_s`` are the frontend's mean (or a percentile the source picks).
    """

    time_s: float
    prefill: PoolObservation | None = None
    decode: PoolObservation | None = None
    requests_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None

    def pool(self, name: str) -> PoolObservation | None:
        """The observation of pool ``name``."""
        return getattr(self, name)


@dataclass(frozen=True)
class PoolState:
    """What the core remembers about one pool between intervals."""

    up_streak: int = 0                  # consecutive intervals wanting more replicas
    down_streak: int = 0                # consecutive intervals wanting fewer
    last_up_s: float | None = None      # time of the last scale-up (or move in)
    last_change_s: float | None = None  # time of the last change in either direction
    desired: int | None = None          # replicas the planner last asked for
    load_history: tuple[float, ...] = ()  # SLA load samples, oldest first, bounded


@dataclass(frozen=True)
class PlannerState:
    """The core's whole memory; ``decide`` returns a new one, never edits this one."""

    prefill: PoolState = field(default_factory=PoolState)
    decode: PoolState = field(default_factory=PoolState)
    intervals: int = 0

    def pool(self, name: str) -> PoolState:
        """The state of pool ``name``."""
        return getattr(self, name)

    def with_pool(self, name: str, state: PoolState) -> PlannerState:
        """A copy with pool ``name`` replaced."""
        return replace(self, **{name: state})


@dataclass(frozen=True)
class Scale:
    """Set ``pool`` to ``target`` replicas (``delta`` from the observed count)."""

    pool: str
    delta: int
    target: int
    reason: str
    detail: str
    kind: Literal["scale"] = "scale"

    @property
    def action(self) -> str:
        """``scale_up`` or ``scale_down``: the metric label."""
        return "scale_up" if self.delta > 0 else "scale_down"


@dataclass(frozen=True)
class Move:
    """Retask ``count`` replicas: ``source`` shrinks to ``source_target``, ``dest`` grows."""

    source: str
    dest: str
    count: int
    source_target: int
    dest_target: int
    reason: str
    detail: str
    kind: Literal["move"] = "move"
    action: Literal["move"] = "move"


@dataclass(frozen=True)
class Hold:
    """Nothing for ``pool`` this interval, and why (steady, cooldown, hysteresis...)."""

    pool: str
    reason: str
    detail: str
    kind: Literal["hold"] = "hold"
    action: Literal["hold"] = "hold"


Action = Scale | Move | Hold


@dataclass(frozen=True)
class PoolDiagnostics:
    """How the core read one pool: the data behind its action, for logs and explain."""

    pool: str
    replicas: int
    signals: dict[str, float | None]
    tripped_up: tuple[str, ...]      # scale_up signals at or above threshold
    down_ok: bool                    # every (read) scale_down signal at or below threshold
    up_streak: int
    down_streak: int
    predicted_load: float | None = None
    sla_replicas: int | None = None
    proposed: int | None = None      # target before budget and moves
    pressure: float = 0.0            # highest signal / threshold ratio (budget order)


@dataclass(frozen=True)
class Decision:
    """The result of one interval: actions to apply, the next state, and diagnostics."""

    actions: list[Action]
    state: PlannerState
    diagnostics: dict[str, PoolDiagnostics]

    def changes(self) -> list[Action]:
        """The actions that change replicas (scales and moves), in apply order."""
        return [a for a in self.actions if not isinstance(a, Hold)]

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form, for logs, ``--json`` output and the explain endpoint."""
        return {"actions": [asdict(a) for a in self.actions],
                "diagnostics": {k: asdict(v) for k, v in self.diagnostics.items()},
                "intervals": self.state.intervals}
