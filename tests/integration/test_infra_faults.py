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

import pytest

from tests.integration.serve_helpers import REPO, ServeRun, dynamo_cmd, http_get_json

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RESTART_DELAY_S = 5.0  # long enough to observe the outage from outside
RECOVERY_BUDGET_S = 15.0


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
        except Exception as exc:  # noqa: BLE001 - a lost or hung request is the failure
            return {"sent": sent, "status": None, "error": repr(exc)}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.results.append(self._one())
            self._stop.wait(0.25)

    def __enter__(self) -> Load:
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
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "COLUMNS": "200"})


def ready_code(url: str) -> int:
    try:
        return http_get_json(url + "/ready", timeout_s=2)[0]
    except OSError:
        return -1


def serves(url: str) -> bool:
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("dependency", ["nats", "etcd"])
def test_embedded_dependency_killed_under_load(tmp_path, dependency):
    run = ServeRun(tmp_path, "graphs.agg_router:Frontend", "-f", "configs/mocker_agg_router.yaml",
                   "--Frontend.port=0", "--Worker.replicas=2",
                   "--Worker.engine_args.speedup_ratio=50",
                   f"--Common.infra.restart_delay_s={RESTART_DELAY_S}")
    try:
        ready = run.wait_ready(180)
        url = next(r["endpoint"] for r in ready["rows"] if r["component"] == "Frontend")
        before = infra_state(run)
        pid = before["pids"][dependency]
        with Load(url) as load:
            time.sleep(2)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            # Detected: /ready answers 503 and `dynamo status` names the dependency.
            deadline = killed_at + RESTART_DELAY_S
            while ready_code(url) != 503:
                assert time.monotonic() < deadline, "/ready never went 503"
                time.sleep(0.05)
            detected_s = time.monotonic() - killed_at
            st = dynamo_status(run)
            assert st.returncode == 3, st.stdout + st.stderr
            assert f"dependency down {dependency}" in " ".join(st.stdout.split()), st.stdout
            # Reaped: the killed server is gone, not a zombie.
            assert not Path(f"/proc/{pid}").exists(), "killed server left a zombie"
            # Repaired: serving again within the budget, on the same endpoints.
            while not (ready_code(url) == 200 and serves(url)):
                assert time.monotonic() - killed_at < RECOVERY_BUDGET_S, \
                    f"not serving {RECOVERY_BUDGET_S}s after the kill:\n{run.output()[-3000:]}"
                time.sleep(0.1)
            recovered_s = time.monotonic() - killed_at
            time.sleep(2)
        after = infra_state(run)
        assert after["endpoints"] == before["endpoints"]
        assert after["pids"][dependency] != pid
        assert dynamo_status(run).returncode == 0
        print(f"\n{dependency}: /ready 503 after {detected_s:.2f}s, serving again "
              f"{recovered_s:.2f}s after the kill ({recovered_s - RESTART_DELAY_S:.2f}s after "
              f"the {RESTART_DELAY_S:.0f}s restart delay); {len(load.results)} requests")
        lost = [r for r in load.results if r["status"] is None]
        assert not lost, lost[:3]
        for r in load.results:
            assert r["status"] == 200 or (r["status"] >= 500 and "error" in r["body"]), r
        refused = [r for r in load.results if r["status"] == 503]
        assert all(r["body"]["error"]["type"] == "service_unavailable" and r["retry_after"]
                   for r in refused
                   if killed_at + detected_s < r["sent"] < killed_at + RESTART_DELAY_S), refused[:3]
        assert any(r["status"] == 200 for r in load.results if r["sent"] > killed_at + recovered_s)
    finally:
        run.stop()
