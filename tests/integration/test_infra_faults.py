"""Kill the embedded etcd or NATS under load: detected, reported, repaired, nothing lost.

A mocker graph serves a few requests a second from a bounded loop while the test
SIGKILLs one embedded server by the pid in the run's state.  While it is down the
frontend's /ready answers 503 and `dynamo status` exits 3 naming it; the supervisor
reaps it (no zombie) and starts it again on the same port; the graph serves again
within 15 s; every request sent got a 200 or an explicit 5xx error body.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

import pytest

from splitserve.infra.embedded import EmbeddedInfra
from splitserve.contracts.kit.procs import free_port
from tests.integration.serve_helpers import REPO, ServeRun, dynamo_cmd, http_get_json, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.deep, pytest.mark.slow]

RESTART_DELAY_S = 8.0  # long enough to observe the outage from outside, status included
RECOVERY_BUDGET_S = 15.0
# After a lease loss every replica restarts; on a busy 2-core machine the frontend alone
# takes up to ~20 s to load its tokenizer again.
LEASE_LOSS_BUDGET_S = 60.0


class Load:
    """A bounded request loop (about 4 req/s) recording every outcome."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> dict:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "tell me a story",
                           "max_tokens": 8}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        sent = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return {"sent": sent, "status": r.status, "body": json.loads(r.read())}
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = {"raw": raw[:200].decode(errors="replace")}
            return {"sent": sent, "status": e.code, "body": parsed,
                    "retry_after": e.headers.get("Retry-After")}
        except urllib.error.URLError as exc:
            # urllib wraps only what fails while connecting and sending: refused, or reset
            # before the request was written (a frontend closing its listener with the
            # connection still in the accept backlog).  Never delivered, like refused.
            if isinstance(exc.reason, (ConnectionRefusedError, BrokenPipeError,
                                       ConnectionResetError)):
                return {"sent": sent, "status": "refused", "error": repr(exc)}
            return {"sent": sent, "status": None, "error": repr(exc)}
        except Exception as exc:  # noqa: BLE001 - a lost or hung request is the failure
            return {"sent": sent, "status": None, "error": repr(exc)}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self._one())
            self._stop.wait(0.25)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "a request hung past its timeout"


def infra_state(run: ServeRun) -> dict:
    return json.loads((Path(run.info()["run_dir"]) / "infra" / "infra.json").read_text())


def dynamo_status(run: ServeRun) -> subprocess.CompletedProcess:
    return subprocess.run([*dynamo_cmd(), "status", "--state-dir", str(run.state)], cwd=REPO,
                          capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ, "COLUMNS": "200"})


def ready_code(url: str) -> int:
    try:
        return http_get_json(url + "/ready", timeout_s=2)[0]
    except OSError:
        return -1


def all_ready(run: ServeRun) -> bool:
    try:
        return all(r["state"] == "ready" for r in run.status()["replicas"])
    except OSError:
        return False


def serves(url: str) -> bool:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def outage_under_load(run: ServeRun, dependency: str, pid: int, revive=None,
                      revive_after_s: float = RESTART_DELAY_S,
                      frontend_restarts: bool = False,
                      budget_s: float = RECOVERY_BUDGET_S) -> dict:
    """Kill ``dependency`` (pid) under load; check detection, report, recovery, no loss.

    ``revive`` (external servers) starts it again after ``revive_after_s``; without it
    the supervisor must.  ``frontend_restarts``: the frontend is restarted during the
    outage, so connections refused meanwhile (requests never accepted) are expected.
    Returns the measured times.
    """
    url = next(r["endpoint"] for r in run.status()["replicas"] if r["component"] == "Frontend")
    with Load(url) as load:
        time.sleep(2)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        # Detected: /ready answers 503 and `dynamo status` names the dependency.
        while ready_code(url) != 503:
            assert time.monotonic() < killed_at + revive_after_s, "/ready never went 503"
            time.sleep(0.05)
        detected_s = time.monotonic() - killed_at
        st = dynamo_status(run)
        assert st.returncode == 3, st.stdout + st.stderr
        assert f"dependency down {dependency}" in " ".join(st.stdout.split()), st.stdout
        if revive is not None:
            time.sleep(max(0.0, killed_at + revive_after_s - time.monotonic()))
            revive()
        back_at = killed_at + revive_after_s
        # Repaired: every replica ready and the frontend serving, within the budget once
        # the server is back.
        while not (all_ready(run) and ready_code(url) == 200 and serves(url)):
            assert time.monotonic() - back_at < budget_s, \
                f"not serving {budget_s}s after {dependency} came back:\n" \
                f"{run.output()[-3000:]}"
            time.sleep(0.1)
        recovered_s = time.monotonic() - killed_at
        time.sleep(2)
    lost = [r for r in load.results if r["status"] is None]
    assert not lost, lost[:3]
    refused = [r for r in load.results if r["status"] == "refused"]
    assert not refused or frontend_restarts, refused[:3]
    assert all(killed_at < r["sent"] < killed_at + recovered_s for r in refused), refused[:3]
    for r in (r for r in load.results if r["status"] != "refused"):
        assert r["status"] == 200 or (r["status"] >= 500 and "error" in r["body"]), r
    unavailable = [r for r in load.results if r["status"] == 503
                   and killed_at + detected_s < r["sent"] < back_at]
    assert all(r["body"]["error"]["type"] == "service_unavailable" and r["retry_after"]
               for r in unavailable), unavailable[:3]
    assert any(r["status"] == 200 for r in load.results if r["sent"] > killed_at + recovered_s)
    times = {"detected_s": detected_s, "recovered_s": recovered_s,
             "after_back_s": recovered_s - revive_after_s, "requests": len(load.results),
             "errors": len([r for r in load.results if r["status"] not in (200, "refused")]),
             "refused": len(refused)}
    print(f"\n{dependency}: {times}")
    return times


def mocker_run(tmp_path, *extra: str, env: dict | None = None, port: int = 0) -> ServeRun:
    run = ServeRun(tmp_path, "graphs.agg_router:Frontend", "-f", "configs/mocker_agg_router.yaml",
                   f"--Frontend.port={port}", "--Worker.replicas=2",
                   "--Worker.engine_args.speedup_ratio=50", *extra, env=env)
    run.wait_ready(180)
    return run


@pytest.mark.parametrize("dependency", ["nats", "etcd"])
def test_embedded_dependency_killed_under_load(tmp_path, dependency):
    run = mocker_run(tmp_path, f"--Common.infra.restart_delay_s={RESTART_DELAY_S}")
    try:
        before = infra_state(run)
        pid = before["pids"][dependency]
        outage_under_load(run, dependency, pid)
        # Reaped (no zombie) and restarted on the same endpoints.
        assert not Path(f"/proc/{pid}").exists(), "killed server left a zombie"
        after = infra_state(run)
        assert after["endpoints"] == before["endpoints"]
        assert after["pids"][dependency] != pid
        assert dynamo_status(run).returncode == 0
    finally:
        run.stop()


@pytest.mark.parametrize("dependency", ["nats", "etcd"])
def test_external_dependency_down_for_long_is_reported_and_survived(tmp_path, dependency):
    """External servers: the supervisor only reports; components reconnect when they
    return.  25 s is long enough for the router's load reports to go stale; for etcd the
    graph runs with a 60 s lease TTL so the runtimes keep their leases through it."""
    infra = EmbeddedInfra(tmp_path / "ext")
    with infra as ep:
        run = mocker_run(tmp_path, "--Common.infra.etcd_lease_ttl_s=60",
                         env={**os.environ, **ep.env()})
        try:
            outage_under_load(run, dependency, infra.pids()[dependency],
                              revive=lambda: infra.restart(dependency), revive_after_s=25)
            wait_until(lambda: dynamo_status(run).returncode == 0, 30, 1, "status exit 0")
        finally:
            run.stop()


def test_etcd_outage_past_the_lease_restarts_replicas_that_lost_it(tmp_path):
    """An etcd outage three times the lease TTL makes every runtime give its lease up
    (its registrations vanish and it never registers again); the supervisor restarts
    those replicas, the frontend included, once etcd is back.  Recovery is then bounded
    by how fast the replicas start, not by the 15 s of a short outage.  The graph runs
    with the shortest TTL the config allows (5 s), so a 15 s outage is past it; with
    Dynamo's default a runtime gives up only after 20-30 s."""
    infra = EmbeddedInfra(tmp_path / "ext")
    with infra as ep:
        run = mocker_run(tmp_path, "--Common.infra.etcd_lease_ttl_s=5",
                         env={**os.environ, **ep.env()}, port=free_port())
        try:
            outage_under_load(run, "etcd", infra.pids()["etcd"],
                              revive=lambda: infra.restart("etcd"), revive_after_s=15,
                              frontend_restarts=True, budget_s=LEASE_LOSS_BUDGET_S)
            assert "etcd lease lost by" in run.output()
            wait_until(lambda: dynamo_status(run).returncode == 0, 30, 1, "status exit 0")
        finally:
            run.stop()


def test_embedded_restart_reaps_and_keeps_ports_and_data(tmp_path):
    """exited() reaps a killed server; restart() brings it back on the same port with
    its data: etcd keys and JetStream streams survive."""
    import asyncio

    import nats

    from splitserve.contracts.kit.etcd import etcd_client, get_prefix

    infra = EmbeddedInfra(tmp_path / "infra")
    with infra as ep:
        async def seed():
            async with etcd_client(ep.etcd) as c:
                await c.put(b"splitserve-test/key", b"v")
            nc = await nats.connect(ep.nats)
            await nc.jetstream().add_stream(name="KEEP", subjects=["keep.>"])
            await nc.close()

        async def check():
            keys = await get_prefix(ep.etcd, "splitserve-test/")
            nc = await nats.connect(ep.nats)
            info = await nc.jetstream().stream_info("KEEP")
            await nc.close()
            return keys, info.config.name

        asyncio.run(seed())
        for name in ("nats", "etcd"):
            pid = infra.pids()[name]
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda n=name: n in infra.exited(), 5, 0.05, f"{name} seen as exited")
            assert not Path(f"/proc/{pid}").exists(), "not reaped"
            assert infra.restart(name) != pid
        assert infra.exited() == {}
        keys, stream = asyncio.run(check())
        assert [v for _, v in keys] == [b"v"] and stream == "KEEP"
        assert json.loads((tmp_path / "infra" / "infra.json").read_text())["endpoints"]["nats"] \
            == ep.nats
