"""The supervisor's dependency watch: reap and restart embedded servers after the delay,
report outages, and restart replicas whose runtime lost its etcd lease once etcd is back."""

from __future__ import annotations

import asyncio
import sys

import pytest

from splitserve.infra.embedded import InfraEndpoints
from splitserve.serve.graph import load_graph
from splitserve.serve.plan import load_plan
from splitserve.serve.supervisor import Replica, Supervisor

pytestmark = pytest.mark.unit

GRAPH = "tests.fixtures.echo_graph:EchoFront"
ENDPOINTS = InfraEndpoints(etcd="http://127.0.0.1:1", nats="nats://127.0.0.1:2", embedded=True)


class FakeInfra:
    """Embedded servers as the watch sees them: which exited, and restart()."""

    def __init__(self) -> None:
        self.dead: dict[str, int] = {}
        self.restarted: list[str] = []

    def exited(self) -> dict[str, int]:
        return dict(self.dead)

    def restart(self, name: str) -> int:
        self.restarted.append(name)
        self.dead.pop(name)
        return 4242


def make_supervisor(tmp_path, health: dict[str, bool], infra=None) -> Supervisor:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("Common:\n  namespace: test\n")
    g = load_graph(GRAPH)
    plan = load_plan(g, GRAPH, cfg, None, g.defined)
    return Supervisor(plan, tmp_path / "run", {}, printer=lambda p, line: None, infra=infra,
                      endpoints=ENDPOINTS, prober=lambda e, n, t: dict(health))


async def until(pred, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_embedded_server_that_exited_is_restarted_after_the_delay(tmp_path):
    health = {"etcd": True, "nats": True}
    infra = FakeInfra()

    async def scenario():
        sup = make_supervisor(tmp_path, health, infra)
        task = asyncio.create_task(sup.watch_dependencies(0.01, restart_delay_s=0.3))
        await asyncio.sleep(0.05)
        assert sup.deps_up.is_set() and sup.deps.down() == []
        infra.dead["nats"] = -9
        health["nats"] = False
        await until(lambda: not sup.deps_up.is_set())
        assert sup.deps.down() == ["nats"] and infra.restarted == []
        await until(lambda: infra.restarted == ["nats"])
        health["nats"] = True
        await until(sup.deps_up.is_set)
        rows = {r["name"]: r for r in sup.dependency_rows()}
        sup.shutting_down = True
        await asyncio.wait_for(task, 2)
        return rows

    rows = asyncio.run(scenario())
    assert rows["nats"]["state"] == "up" and rows["nats"]["restarts"] == 1
    assert rows["nats"]["embedded"] is True


def test_external_outage_is_reported_not_restarted(tmp_path):
    health = {"etcd": True, "nats": True}

    async def scenario():
        sup = make_supervisor(tmp_path, health, infra=None)
        task = asyncio.create_task(sup.watch_dependencies(0.01, restart_delay_s=0.0))
        health["etcd"] = False
        await until(lambda: sup.deps.down() == ["etcd"])
        down_rows = sup.dependency_rows()
        health["etcd"] = True
        await until(sup.deps_up.is_set)
        sup.shutting_down = True
        await asyncio.wait_for(task, 2)
        return down_rows

    rows = {r["name"]: r for r in asyncio.run(scenario())}
    assert rows["etcd"]["state"] == "down" and rows["etcd"]["embedded"] is False


def test_replica_that_lost_its_lease_is_restarted_once_etcd_is_back(tmp_path):
    health = {"etcd": False, "nats": True}

    async def scenario():
        sup = make_supervisor(tmp_path, health)
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c",
                                                    "import time; time.sleep(60)")
        rep = Replica(component="EchoWorker", index=0, status_file=tmp_path / "s.json",
                      config_file=tmp_path / "c.json", proc=proc, state="ready",
                      lease_lost=True)
        sup.replicas["EchoWorker"] = [rep]
        task = asyncio.create_task(sup.watch_dependencies(0.01, restart_delay_s=0.0))
        await asyncio.sleep(0.2)
        assert proc.returncode is None, "restarted while etcd was still down"
        health["etcd"] = True
        code = await asyncio.wait_for(proc.wait(), 5)
        sup.shutting_down = True
        await asyncio.wait_for(task, 2)
        return code, rep

    code, rep = asyncio.run(scenario())
    assert code == -15 and rep.recycling and not rep.lease_lost
