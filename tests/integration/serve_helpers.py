"""Run `dynamo serve` as a real subprocess in tests and clean up every process by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from splitserve.infra.procs import pid_alive

REPO = Path(__file__).resolve().parents[2]


def dynamo_cmd() -> list[str]:
    return [sys.executable, "-m", "splitserve.cli.main"]


class ServeRun:
    """A `dynamo serve` subprocess with helpers to wait for readiness and stop it."""

    def __init__(self, tmp: Path, graph: str, *args: str, env: dict | None = None) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.state = tmp / "state"
        self.ready_file = tmp / f"ready-{time.monotonic_ns()}.json"
        self.log_path = tmp / f"serve-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")
        full_env = {**os.environ, **(env or {})}
        if env is None:
            full_env.pop("ETCD_ENDPOINTS", None)
            full_env.pop("NATS_SERVER", None)
        self.proc = subprocess.Popen(
            [*dynamo_cmd(), "serve", graph, "--no-status", "--state-dir", str(self.state),
             "--ready-file", str(self.ready_file), *args],
            cwd=REPO, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.seen_pids: set[int] = set()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                data = json.loads(self.ready_file.read_text())
                self.seen_pids |= {r["pid"] for r in data["rows"]}
                return data
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout_s}s:\n{self.output()}")

    def control(self) -> str:
        files = list((self.state / "supervisors").glob("*.json"))
        assert files, "no supervisor registered"
        info = json.loads(files[0].read_text())
        return info["control"]

    def info(self) -> dict:
        files = list((self.state / "supervisors").glob("*.json"))
        return json.loads(files[0].read_text())

    def token(self) -> str:
        """The control endpoint's bearer token, from the run directory (0600)."""
        return Path(self.info()["token_file"]).read_text().strip()

    def status(self) -> dict:
        req = urllib.request.Request(self.control() + "/v1/status",
                                     headers={"Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            data = json.loads(r.read())
        self.seen_pids |= {r["pid"] for r in data["replicas"] if r["pid"]}
        return data

    def replicas(self, component: str) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["component"] == component]

    def infra_pids(self) -> list[int]:
        run_dir = Path(self.info()["run_dir"])
        state = json.loads((run_dir / "infra" / "infra.json").read_text())
        return list(state["pids"].values())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self.kill_all()
        return code

    def kill_all(self) -> None:
        """Last resort cleanup: kill the serve process group and every pid we saw."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        for pid in self.seen_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def http_get_json(url: str, timeout_s: float = 10, token: str | None = None
                  ) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http_post_json(url: str, body: dict, timeout_s: float = 10, token: str | None = None
                   ) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (an engine's own processes, a mocker worker's mocker),
    read from /proc; for tests that kill a replica together with what it started."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in map(int, f.read().split()):
                out += [child, *descendants(child)]
    return out


def wait_until(pred, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
