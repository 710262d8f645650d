"""Which replicas a scale-down removes (those holding no requests first), and how long
it gives each to stop."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.serve.supervisor import Replica, removal_order

pytestmark = pytest.mark.unit


def rep(index: int, state: str) -> Replica:
    return Replica("DecodeWorker", index, Path(f"s{index}"), Path(f"c{index}"), state=state)


def test_not_ready_replicas_go_first_then_the_newest():
    # replica 0 was killed and is loading again; 1 and 2 serve streams
    live = [rep(0, "loading"), rep(1, "ready"), rep(2, "ready")]
    assert [r.index for r in removal_order(live)] == [0, 2, 1]


def test_all_ready_removes_the_newest_first():
    live = [rep(i, "ready") for i in range(3)]
    assert [r.index for r in removal_order(live)] == [2, 1, 0]


def test_restarting_and_starting_replicas_before_ready_ones():
    live = [rep(0, "ready"), rep(1, "restarting"), rep(2, "starting"), rep(3, "ready")]
    assert [r.index for r in removal_order(live)] == [2, 1, 3, 0]


def test_a_removed_replica_gets_its_drain_and_its_kv_hold_before_it_is_killed():
    from types import SimpleNamespace

    from splitserve.components.engines.torch_cpu.sections import TorchWorkerConfig
    from splitserve.serve.supervisor import DRAIN_MARGIN_S, Supervisor

    sup = SimpleNamespace(plan=SimpleNamespace(common=SimpleNamespace(shutdown_timeout_s=20)))

    def grace(**cfg) -> float:
        return Supervisor.stop_grace_s(sup, SimpleNamespace(config=TorchWorkerConfig(**cfg)))

    assert grace(drain_timeout_s=5) == 20  # the graph's shutdown deadline is longer
    assert grace(drain_timeout_s=30) == 30 + DRAIN_MARGIN_S
    assert grace(drain_timeout_s=30, kv_moves=True, kv_move_hold_s=15) == 45 + DRAIN_MARGIN_S
