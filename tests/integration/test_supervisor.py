"""`dynamo serve` of a two-component test graph with real etcd, NATS and processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from splitserve.contracts.kit.etcd import get_prefix
from splitserve.infra.embedded import EmbeddedInfra
from splitserve.contracts.kit.procs import pid_alive
from tests.fixtures.echo_front import ECHO_TOKEN
from tests.integration.serve_helpers import (
    REPO,
    ServeRun,
    dynamo_cmd,
    http_get_json,
    http_post_json,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

GRAPH = "tests.fixtures.echo_graph:EchoFront"


def front_url(run: ServeRun) -> str:
    return next(r["endpoint"] for r in run.replicas("EchoFront") if r["state"] == "ready")


def echo(run: ServeRun, text: str) -> tuple[int, dict]:
    return http_get_json(f"{front_url(run)}/echo/{text}", token=ECHO_TOKEN)


def test_comes_up_answers_restarts_and_shuts_down_clean(tmp_path):
    t0 = time.monotonic()
    run = ServeRun(tmp_path, GRAPH, "--EchoWorker.replicas=2")
    try:
        run.wait_ready(30)
        up_s = time.monotonic() - t0
        assert up_s < 10, f"graph took {up_s:.1f}s to come up"
        infra = run.infra_pids()
        run.seen_pids |= set(infra)
        code, body = echo(run, "hello")
        assert code == 200 and body["text"] == "hello"
        # round-robin reaches both workers
        pids = {echo(run, f"x{i}")[1]["pid"] for i in range(6)}
        assert len(pids) == 2

        victim = run.replicas("EchoWorker")[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: any(r["pid"] != victim["pid"] and r["state"] == "ready"
                               and r["restarts"] == 1 for r in run.replicas("EchoWorker")),
                   20, what="killed worker restarted")
        run.status()
        # requests keep succeeding once the replacement registered
        wait_until(lambda: all(echo(run, f"after{i}")[0] == 200 for i in range(4)), 15,
                   what="requests succeed after restart")
        code = run.stop(signal.SIGTERM)
        assert code == 0, run.output()
    finally:
        run.kill_all()
    leftovers = [p for p in run.seen_pids if pid_alive(p)]
    assert leftovers == [], f"orphans: {leftovers}"
    assert "graph ready" in run.output()


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(name))
    return out


def kill_with_groups(run: ServeRun) -> None:
    """Last-resort cleanup of a run whose replicas started processes of their own."""
    run.kill_all()
    for pid in run.seen_pids:
        for member in group_members(pid):
            os.kill(member, signal.SIGKILL)


def test_killed_replica_whose_children_survive_is_restarted(tmp_path):
    """A SIGKILLed replica's own children (an engine's processes) keep its output pipe
    open; the supervisor still sees the exit, stops them and restarts the replica."""
    run = ServeRun(tmp_path, GRAPH, "--EchoWorker.spawn_child=true")
    try:
        run.wait_ready(30)
        victim = run.replicas("EchoWorker")[0]
        wait_until(lambda: len(group_members(victim["pid"])) == 2, 10, what="child started")
        (child,) = [p for p in group_members(victim["pid"]) if p != victim["pid"]]
        run.seen_pids.add(child)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: any(r["pid"] != victim["pid"] and r["state"] == "ready"
                               and r["restarts"] == 1 for r in run.replicas("EchoWorker")),
                   20, what="killed worker restarted")
        assert not pid_alive(child), "the dead replica's child is still running"
        wait_until(lambda: echo(run, "again")[0] == 200, 15, what="served after restart")
        assert run.stop(signal.SIGTERM) == 0, run.output()
    finally:
        kill_with_groups(run)


def test_sigterm_leaves_no_etcd_registrations_with_external_infra(tmp_path):
    with EmbeddedInfra(tmp_path / "ext") as ep:
        env = {**os.environ, **ep.env()}
        run = ServeRun(tmp_path, GRAPH, "--EchoWorker.replicas=2", env=env)
        try:
            run.wait_ready(30)
            keys = asyncio.run(get_prefix(ep.etcd, "v1/instances/dynamo/"))
            assert len(keys) == 2, keys
            assert "external etcd" in run.output()
            assert not (run.tmp / "state" / "runs").exists() or not any(
                (p / "infra").exists() for p in (run.tmp / "state" / "runs").iterdir())
            assert run.stop(signal.SIGINT) == 0, run.output()
        finally:
            run.kill_all()
        assert asyncio.run(get_prefix(ep.etcd, "v1/instances/")) == []
        assert [p for p in run.seen_pids if pid_alive(p)] == []


def test_two_runs_do_not_collide_and_scale_via_control(tmp_path):
    a = ServeRun(tmp_path / "a", GRAPH)
    b = ServeRun(tmp_path / "b", GRAPH)
    try:
        a.wait_ready(30)
        b.wait_ready(30)
        assert a.info()["etcd"] != b.info()["etcd"]
        assert echo(a, "one")[1]["text"] == "one" and echo(b, "two")[1]["text"] == "two"

        code, body = http_post_json(a.control() + "/v1/components/EchoWorker/replicas",
                                    {"replicas": 2}, token=a.token())
        assert code == 200, body
        wait_until(lambda: sum(r["state"] == "ready" for r in a.replicas("EchoWorker")) == 2,
                   20, what="scale up to 2")
        a.status()
        code, body = http_post_json(a.control() + "/v1/components/EchoWorker/replicas",
                                    {"replicas": 1}, token=a.token())
        assert code == 200
        wait_until(lambda: len(a.replicas("EchoWorker")) == 1, 20, what="scale down to 1")
        assert echo(a, "still")[1]["text"] == "still"
        assert http_post_json(a.control() + "/v1/components/Nope/replicas",
                              {"replicas": 1}, token=a.token())[0] == 404
        assert http_post_json(a.control() + "/v1/components/EchoWorker/replicas",
                              {"replicas": "two"}, token=a.token())[0] == 400
        assert a.stop() == 0 and b.stop() == 0
    finally:
        a.kill_all()
        b.kill_all()
    assert [p for p in a.seen_pids | b.seen_pids if pid_alive(p)] == []


def test_crash_loop_gives_up_and_exits_non_zero(tmp_path):
    run = ServeRun(tmp_path, GRAPH, "--EchoWorker.crash_after=1",
                   "--Common.restart.max_restarts=1", "--Common.restart.backoff_initial_s=0.1")
    try:
        run.wait_ready(30)
        for _ in range(2):
            wait_until(lambda: any(r["state"] == "ready" for r in run.replicas("EchoWorker")),
                       20, what="worker ready")
            echo(run, "boom")
        assert run.proc.wait(timeout=30) == 1
        assert "failed 2 times" in run.output()
    finally:
        run.kill_all()
    assert [p for p in run.seen_pids if pid_alive(p)] == []


def test_bad_config_starts_nothing(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("EchoWorker:\n  replicas: two\n")
    res = subprocess.run([*dynamo_cmd(), "serve", GRAPH, "-f", str(cfg), "--state-dir",
                          str(tmp_path / "state")], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    assert f"{cfg}: invalid config" in res.stderr
    assert "EchoWorker.replicas" in res.stderr
    assert not (tmp_path / "state").exists()


def test_a_busy_frontend_port_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([*dynamo_cmd(), "serve", "graphs.agg_router:Frontend", "-f",
                              "configs/mocker_agg_router.yaml", f"--Frontend.port={port}",
                              "--state-dir", str(tmp_path / "state")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"Frontend.port: cannot listen on 127.0.0.1:{port}: Address already in use" \
        in res.stderr
    assert not (tmp_path / "state").exists()  # no infrastructure, no replica


def test_dry_run_prints_plan(tmp_path):
    res = subprocess.run([*dynamo_cmd(), "serve", GRAPH, "--dry-run", "--EchoWorker.replicas=3"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "EchoWorker x3" in res.stdout and "links: EchoWorker" in res.stdout
    assert "embedded etcd + NATS" in res.stdout


def test_control_answers_while_a_replica_floods_its_output_and_restarts(tmp_path):
    """An engine's processes may log without pause (vLLM at start); the supervisor copies
    that output and must still answer its control endpoint at once, also while it
    restarts the flooding replica."""
    run = ServeRun(tmp_path, GRAPH, "--EchoWorker.flood_s=12")
    try:
        run.wait_ready(30)
        victim = run.replicas("EchoWorker")[0]
        slowest, deadline, killed = 0.0, time.monotonic() + 8, False
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            run.status()
            slowest = max(slowest, time.monotonic() - t0)
            if not killed and time.monotonic() > deadline - 6:
                os.kill(victim["pid"], signal.SIGKILL)  # its flooding child lives on
                killed = True
            time.sleep(0.05)
        assert slowest < 1.0, f"the control endpoint took {slowest:.2f}s under the flood"
        wait_until(lambda: any(r["pid"] != victim["pid"] and r["state"] == "ready"
                               for r in run.replicas("EchoWorker")), 20,
                   what="flooding replica restarted")
        log = (Path(run.info()["run_dir"]) / "logs" / "EchoWorker-0.log").stat().st_size
        assert log > 1_000_000  # the flood really went through the supervisor
        assert run.stop(signal.SIGTERM) == 0, run.output()[-2000:]
    finally:
        kill_with_groups(run)


def test_replicas_die_with_a_sigkilled_supervisor(tmp_path):
    """Children get the parent-death signal from an exec wrapper, not from Python code
    run between fork and exec (unsafe in the threaded supervisor)."""
    run = ServeRun(tmp_path, GRAPH)
    try:
        run.wait_ready(30)
        pids = [r["pid"] for r in run.replicas("EchoWorker") + run.replicas("EchoFront")]
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(5)
        wait_until(lambda: not any(pid_alive(p) for p in pids), 15,
                   what="replicas gone after their supervisor was killed")
    finally:
        run.kill_all()
