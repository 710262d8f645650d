"""The live loop runs the same core as the simulator: same observations, same decisions."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.contracts.kit.waiting import poll_until
from splitserve.planner import Observation, PlannerState
from splitserve.planner.connectors import DryRunConnector, replica_steps
from splitserve.planner.fleet import FleetModel
from splitserve.planner.loop import Planner, describe
from splitserve.planner.metrics import PlannerMetrics
from splitserve.planner.simulate import simulate
from splitserve.planner.traces import TraceRequest

from .planner_factories import obs, pobs, policy, pool
from .planner_run import run

pytestmark = pytest.mark.unit


class ReplaySource:
    """A source that returns recorded observations, as a live source would."""

    def __init__(self, observations: list[Observation]) -> None:
        self.observations = list(observations)
        self.asked: list[float] = []

    async def observe(self, now: float) -> Observation:
        self.asked.append(now)
        return self.observations.pop(0)


def burst_trace() -> list[TraceRequest]:
    """1 req/s for 60 s, 8 req/s for 120 s, then 1 req/s for 240 s; 4000-token prompts."""
    out, t = [], 0.0
    while t < 420:
        rate = 8.0 if 60 <= t < 180 else 1.0
        out.append(TraceRequest(t, 4000, 200))
        t += 1.0 / rate
    return out


def budget_policy():
    """Six GPUs; decode starts over-provisioned, so the burst is met by moves."""
    return policy(prefill=pool(min_replicas=1, max_replicas=8,
                               up={"queue_length": 4, "gpu_utilization": 85},
                               down={"queue_length": 1, "gpu_utilization": 40}),
                  decode=pool(min_replicas=1, max_replicas=8,
                              up={"queue_length": 8, "kv_cache_usage": 80,
                                  "gpu_utilization": 85},
                              down={"queue_length": 1, "kv_cache_usage": 30,
                                    "gpu_utilization": 40}),
                  cooldown={"scale_up_s": 20, "scale_down_s": 40},
                  hysteresis={"scale_up_intervals": 1, "scale_down_intervals": 6},
                  gpu_budget={"total_gpus": 6})


def budget_fleet() -> FleetModel:
    return FleetModel(prefill_tokens_per_s=12000, decode_tokens_per_s=2000, decode_replicas=5,
                      startup_s=10)


def test_simulator_and_live_loop_decide_alike():
    p = budget_policy()
    sim = simulate(burst_trace(), p, budget_fleet(), interval_s=10)
    assert any(d.changes() for d in sim.decisions)  # the trace makes the planner act

    source, conn = ReplaySource(sim.observations), DryRunConnector()
    live = Planner(p, source, conn)

    async def main():
        return [await live.tick(o.time_s) for o in sim.observations]

    decisions = asyncio.run(main())
    assert decisions == sim.decisions
    assert source.asked == [o.time_s for o in sim.observations]
    sent = [(pool, n) for d in sim.decisions for pool, n, _ in replica_steps(d.changes())]
    assert conn.applied == sent  # the live connector was asked for what the model applied


def test_tick_exports_metrics_and_advances_state():
    p = policy(prefill=pool(), decode=pool())
    metrics = PlannerMetrics()
    seen = [obs(0, prefill=pobs(2, queue=9), decode=pobs(3, queue=0))]
    live = Planner(p, ReplaySource(seen), DryRunConnector(), metrics)
    decision = asyncio.run(live.tick(0.0))
    assert decision == run(p, seen)[0] and live.state == decision.state
    get = metrics.registry.get_sample_value
    assert get("splitserve_planner_decisions_total",
               {"pool": "prefill", "action": "scale_up", "reason": "scale-up"}) == 1
    assert get("splitserve_planner_decisions_total",
               {"pool": "decode", "action": "scale_down", "reason": "scale-down"}) == 1
    assert get("splitserve_planner_replicas", {"pool": "prefill", "kind": "desired"}) == 3
    assert get("splitserve_planner_replicas", {"pool": "prefill", "kind": "observed"}) == 2
    assert describe(decision) == [
        "decode -1 -> 2 [scale-down] at or below scale_down: queue_length 0",
        "prefill +1 -> 3 [scale-up] scale_up reached: queue_length 9"]


def test_run_ticks_until_stopped_and_survives_errors():
    p = policy(prefill=pool(), interval_s=0.01)

    class Flaky:
        calls = 0

        async def observe(self, now: float) -> Observation:
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise OSError("supervisor restarting")
            return obs(now, prefill=pobs(2, queue=0))

    async def main():
        stop = asyncio.Event()
        live = Planner(p, Flaky(), DryRunConnector())
        task = asyncio.create_task(live.run(stop))
        assert await poll_until(lambda: Flaky.calls >= 4, 10, poll_s=0.005)
        stop.set()
        await asyncio.wait_for(task, 1)
        return live

    live = asyncio.run(main())
    assert live.state.intervals >= 3 and live.state != PlannerState()
