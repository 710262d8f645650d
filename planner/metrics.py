"""Prometheus metrics of the planner: decisions by reason, desired vs observed replicas.

The core returns decisions as data; this adapter turns each into counter increments
and gauge settings, so the core never touches metrics.  Called once per interval by
``loop.Planner`` after the connector applied the actions.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.contracts.metrics import PREFIX

from .model import Decision, Move, Observation, Scale


class PlannerMetrics:
    """``splitserve_planner_*`` metrics in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(f"{PREFIX}_planner_decisions_total",
                                 "Planner actions per pool, by action and reason",
                                 ["pool", "action", "reason"], registry=r)
        self.replicas = Gauge(f"{PREFIX}_planner_replicas",
                              "Replicas per pool: desired (planner) and observed (fleet)",
                              ["pool", "kind"], registry=r)
        self.apply_errors = Counter(f"{PREFIX}_planner_apply_errors_total",
                                    "Actions a connector failed to apply", ["pool"], registry=r)

    def record(self, decision: Decision, observation: Observation) -> None:
        """Count the interval's actions and set the replica gauges."""
        for a in decision.actions:
            if isinstance(a, Move):
                self.decisions.labels(a.source, "move_out", a.reason).inc()
                self.decisions.labels(a.dest, "move_in", a.reason).inc()
            else:
                action = a.action if isinstance(a, Scale) else "hold"
                self.decisions.labels(a.pool, action, a.reason).inc()
        for pool in ("prefill", "decode"):
            desired = decision.state.pool(pool).desired
            if desired is not None:
                self.replicas.labels(pool, "desired").set(desired)
            seen = observation.pool(pool)
            if seen is not None:
                self.replicas.labels(pool, "observed").set(seen.replicas)

    def failed(self, pool: str) -> None:
        """Count one action the connector could not apply."""
        self.apply_errors.labels(pool).inc()
