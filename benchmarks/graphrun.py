"""Run a ``dynamo serve`` graph as a subprocess for a benchmark, and clean up after it.

    with GraphRun("graphs.disagg:Frontend", "configs/mocker_disagg.yaml",
                  ["--DecodeWorker.engine_args.speedup_ratio=10"]) as g:
        print(g.url)                                  # the frontend's base URL
        g.metric_total("DecodeWorker", "splitserve_disagg_decisions_total", where="remote")

The graph starts on a free port (``--Frontend.port=0``) with its own state directory and
ready file in a scratch directory; embedded etcd/NATS come with it (inherited
``ETCD_ENDPOINTS`` / ``NATS_SERVER`` are dropped).  Waits are bounded.  Stopping sends
SIGTERM to ``dynamo serve`` (its own process group), waits, then SIGKILLs the group and
every replica, engine and infrastructure pid seen while it ran that is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[1]


def fetch_json(url: str, timeout_s: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def parse_prometheus(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus text format -> ``{sample name: {sorted label pairs: value}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(url: str, timeout_s: float = 10) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse_prometheus(r.read().decode())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out |= {int(p) for p in (task / "children").read_text().split()}
    return out


class GraphRun:
    """``dynamo serve GRAPH -f CONFIG OVERRIDES...`` in a scratch directory.

    Subclasses for graphs without a frontend set ``serves_http = False`` and read what
    they need in ``_after_ready``."""

    serves_http = True

    def __init__(self, graph: str, config: str, overrides: list[str] | tuple[str, ...] = (),
                 *, startup_timeout_s: float = 240, stop_timeout_s: float = 60,
                 log_level: str = "warning", keep_dir: bool = False) -> None:
        self.graph, self.config, self.overrides = graph, config, list(overrides)
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.log_level, self.keep_dir = log_level, keep_dir
        self.tmp = Path(tempfile.mkdtemp(prefix="graphrun-"))
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.control = ""
        self.seen_pids: set[int] = set()
        self.startup_s: float | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> GraphRun:
        ready = self.tmp / "ready.json"
        env = {k: v for k, v in os.environ.items() if k not in ("ETCD_ENDPOINTS", "NATS_SERVER")}
        env.setdefault("DYN_LOG", "error")
        self._log = open(self.tmp / "serve.log", "wb")  # noqa: SIM115 - closed in stop()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli.main", "serve", self.graph, "-f", self.config,
             *self.overrides, *(["--Frontend.port=0"] if self.serves_http else []),
             f"--Common.log_level={self.log_level}", "--no-status", "--ready-file", str(ready),
             "--state-dir", str(self.tmp / "state")],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = t0 + self.startup_timeout_s
            while not ready.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"graph exited {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"graph not ready in {self.startup_timeout_s:.0f}s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.2)
            time.sleep(0.05)  # the ready file is written whole, but be kind to slow disks
            rows = json.loads(ready.read_text())["rows"]
            self.seen_pids |= {r["pid"] for r in rows if r.get("pid")}
            if self.serves_http:
                self.url = next(r["endpoint"] for r in rows if r["component"] == "Frontend")
            self.control = self.info()["control"]
            self._after_ready()
            self.status()  # records replica pids
            self._note_descendants()
            self.startup_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def _after_ready(self) -> None:
        """Called once the graph reported ready, before replica pids are recorded."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL of whatever is left; returns the exit code."""
        code = None
        if self.proc is None:
            return code
        with contextlib.suppress(Exception):
            self._note_descendants()
        with contextlib.suppress(Exception):
            run_dir = Path(self.info()["run_dir"])
            infra = json.loads((run_dir / "infra" / "infra.json").read_text())
            self.seen_pids |= set(infra.get("pids", {}).values())
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        else:
            code = self.proc.returncode
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of an unclean exit
        deadline = time.monotonic() + 5  # children die with their parent; give them a moment
        while time.monotonic() < deadline and any(_pid_alive(p) for p in self.seen_pids):
            time.sleep(0.1)
        for pid in self.seen_pids:
            if _pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()
        self.proc = None
        if not self.keep_dir:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return code

    def _note_descendants(self) -> None:
        if self.proc is None:
            return
        todo = [self.proc.pid, *self.seen_pids]
        seen: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo.extend(_children(pid))
        self.seen_pids |= seen - {self.proc.pid}

    # -- introspection -----------------------------------------------------------------
    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / "serve.log").read_text(errors="replace")[-n:]
        return ""

    def info(self) -> dict:
        files = list((self.tmp / "state" / "supervisors").glob("*.json"))
        if not files:
            raise RuntimeError("no supervisor registered")
        return json.loads(files[0].read_text())

    def status(self) -> dict:
        from splitserve.serve.control import supervisor_status

        data = supervisor_status(self.info(), timeout_s=10) or {}
        self.seen_pids |= {r["pid"] for r in data.get("replicas", []) if r.get("pid")}
        return data

    def replicas(self, component: str) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["component"] == component]

    def resolved_config(self, component: str) -> dict:
        plan = self.status()["plan"]["components"]
        return next(c["config"] for c in plan if c["name"] == component)

    def metric_by_labels(self, component: str, name: str, label: str
                         ) -> dict[str, float]:
        """One metric summed over ``component``'s replicas, grouped by one label's value."""
        out: dict[str, float] = {}
        for rep in self.replicas(component):
            if not rep.get("metrics"):
                continue
            for labels, value in scrape(rep["metrics"]).get(name, {}).items():
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out

    def metric_total(self, component: str, name: str, **labels: str) -> float:
        """One metric summed over ``component``'s replicas, samples matching ``labels``."""
        total = 0.0
        for rep in self.replicas(component):
            if not rep.get("metrics"):
                continue
            for lab, value in scrape(rep["metrics"]).get(name, {}).items():
                d = dict(lab)
                if all(d.get(k) == v for k, v in labels.items()):
                    total += value
        return total
