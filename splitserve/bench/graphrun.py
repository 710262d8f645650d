"""Run a ``dynamo serve`` graph as a subprocess, for tests and benchmarks alike, and clean
up every process it started.

``ServeProcess`` is the process: ``dynamo serve GRAPH ARGS...`` in its own process group,
with its state directory, ready file and log under a directory the caller owns; readiness,
the supervisor's files and status, and a stop that ends with SIGKILL of the group and of
every pid seen while it ran (replicas, engines, embedded etcd/NATS).  The tests use it as
is (``tests/integration/serve_helpers.ServeRun``).

``GraphRun`` is what a benchmark wants around it: a scratch directory, the frontend on a
free port, a bounded start, a context manager, and metrics summed over a component's
replicas::

    with GraphRun("graphs.disagg:Frontend", "configs/mocker_disagg.yaml",
                  ["--DecodeWorker.engine_args.speedup_ratio=10"]) as g:
        print(g.url)                                  # the frontend's base URL
        g.metric_total("DecodeWorker", "splitserve_disagg_decisions_total", where="remote")

Inherited ``ETCD_ENDPOINTS`` / ``NATS_SERVER`` are dropped unless the caller passes an
environment, so a graph brings its own embedded etcd and NATS.
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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Self

from splitserve.contracts import prometheus
from splitserve.contracts.prometheus import Samples
from splitserve.contracts.kit.procs import pid_alive

INFRA_ENV = ("ETCD_ENDPOINTS", "NATS_SERVER")


def dynamo_cmd() -> list[str]:
    """The ``dynamo`` command of this interpreter (no console script needed)."""
    return [sys.executable, "-m", "splitserve.cli.main"]


parse_prometheus = prometheus.parse  # the name benchmarks import


def scrape(url: str, timeout_s: float = 10) -> Samples:
    """One ``/metrics`` URL, read by ``splitserve.contracts.prometheus.parse``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return prometheus.parse(r.read().decode())


def children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc; empty once it is gone)."""
    out: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out |= {int(p) for p in (task / "children").read_text().split()}
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (an engine's own processes, a mocker worker's mocker)."""
    out: list[int] = []
    for child in sorted(children(pid)):
        out += [child, *descendants(child)]
    return out


class ServeProcess:
    """A ``dynamo serve`` subprocess: wait for it, ask its supervisor, stop it."""

    def __init__(self, tmp: Path, graph: str, *args: str, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        """Start ``dynamo serve graph *args`` in ``cwd`` (default: this process's working
        directory, which relative config paths in ``args`` are read from)."""
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.state = tmp / "state"
        self.ready_file = tmp / f"ready-{time.monotonic_ns()}.json"
        self.log_path = tmp / f"serve-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill_all()
        if env is None:
            env = {k: v for k, v in os.environ.items() if k not in INFRA_ENV}
        self.proc = subprocess.Popen(
            [*dynamo_cmd(), "serve", graph, "--no-status", "--state-dir", str(self.state),
             "--ready-file", str(self.ready_file), *args],
            cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.seen_pids: set[int] = set()

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def wait_ready(self, timeout_s: float = 60) -> dict:
        """The ready file's contents once ``dynamo serve`` wrote it; AssertionError with
        the log when it exits or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                data = json.loads(self.ready_file.read_text())
                self.seen_pids |= {r["pid"] for r in data["rows"] if r.get("pid")}
                return data
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout_s}s:\n{self.output()}")

    def info(self) -> dict:
        files = list((self.state / "supervisors").glob("*.json"))
        assert files, "no supervisor registered"
        return json.loads(files[0].read_text())

    def control(self) -> str:
        return self.info()["control"]

    def token(self) -> str:
        """The control endpoint's bearer token, from the run directory (0600)."""
        return Path(self.info()["token_file"]).read_text().strip()

    def status(self, timeout_s: float = 5) -> dict:
        req = urllib.request.Request(self.control() + "/v1/status",
                                     headers={"Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = json.loads(r.read())
        self.seen_pids |= {r["pid"] for r in data["replicas"] if r["pid"]}
        return data

    def replicas(self, component: str) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["component"] == component]

    def infra_pids(self) -> list[int]:
        run_dir = Path(self.info()["run_dir"])
        state = json.loads((run_dir / "infra" / "infra.json").read_text())
        return list(state["pids"].values())

    def note_descendants(self) -> None:
        """Remember every process below ``dynamo serve`` and the pids seen so far."""
        todo, seen = [self.proc.pid, *self.seen_pids], set()
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                todo.extend(children(pid))
        self.seen_pids |= seen - {self.proc.pid}

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 40) -> int:
        """Send ``sig`` and wait for the exit code; whatever happens, every process seen
        is killed afterwards.  Raises TimeoutExpired when it did not exit in time."""
        with contextlib.suppress(Exception):
            self.note_descendants()
        with contextlib.suppress(Exception):
            self.seen_pids |= set(self.infra_pids())
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        """Last resort cleanup: kill the serve process group and every pid seen."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # also leftovers of an unclean exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        deadline = time.monotonic() + 5  # children die with their parent; give them a moment
        while time.monotonic() < deadline and any(pid_alive(p) for p in self.seen_pids):
            time.sleep(0.1)
        for pid in self.seen_pids:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self.log.close()


def _raise_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


class GraphRun:
    """``dynamo serve GRAPH -f CONFIG OVERRIDES...`` in a scratch directory, for a benchmark.

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
        self.serve: ServeProcess | None = None
        self.url = ""
        self.control = ""
        self.startup_s: float | None = None
        self._sigterm: object = None  # the handler replaced while running, if any

    @property
    def seen_pids(self) -> set[int]:
        """Every pid seen while it ran (killed on stop if still alive)."""
        return self.serve.seen_pids if self.serve is not None else set()

    @seen_pids.setter
    def seen_pids(self, pids: set[int]) -> None:
        if self.serve is not None:
            self.serve.seen_pids = set(pids)

    def start(self) -> GraphRun:
        self._exit_on_sigterm()
        env = {k: v for k, v in os.environ.items() if k not in INFRA_ENV}
        env.setdefault("DYN_LOG", "error")
        t0 = time.monotonic()
        self.serve = ServeProcess(
            self.tmp, self.graph, "-f", self.config, *self.overrides,
            *(["--Frontend.port=0"] if self.serves_http else []),
            f"--Common.log_level={self.log_level}", env=env)
        try:
            try:
                rows = self.serve.wait_ready(self.startup_timeout_s)["rows"]
            except AssertionError as exc:
                raise RuntimeError(str(exc)[-3000:]) from None
            if self.serves_http:
                self.url = next(r["endpoint"] for r in rows if r["component"] == "Frontend")
            self.control = self.info()["control"]
            self._after_ready()
            self.status()  # records replica pids
            self.serve.note_descendants()
            self.startup_s = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    def _exit_on_sigterm(self) -> None:
        """A benchmark stopped with SIGTERM (a timeout, ``kill``) leaves by SystemExit, so
        its ``with GraphRun(...)`` blocks stop their graphs on the way out instead of
        leaving every replica running; only where nothing else handles SIGTERM."""
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            self._sigterm = signal.signal(signal.SIGTERM, _raise_exit)

    def _after_ready(self) -> None:
        """Called once the graph reported ready, before replica pids are recorded."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGTERM, bounded wait, then SIGKILL of whatever is left; returns the exit code
        (None when it had to be killed)."""
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self.serve is None:
            return None
        serve, self.serve = self.serve, None
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = serve.stop(signal.SIGTERM, self.stop_timeout_s)
        if not self.keep_dir:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return code

    def log_tail(self, n: int = 3000) -> str:
        return self.serve.output()[-n:] if self.serve is not None else ""

    def info(self) -> dict:
        assert self.serve is not None, "not started"
        return self.serve.info()

    def status(self) -> dict:
        assert self.serve is not None, "not started"
        return self.serve.status(timeout_s=10)

    def replicas(self, component: str) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["component"] == component]

    def resolved_config(self, component: str) -> dict:
        plan = self.status()["plan"]["components"]
        return next(c["config"] for c in plan if c["name"] == component)

    def _scrapes(self, component: str):
        for rep in self.replicas(component):
            if rep.get("metrics"):
                yield scrape(rep["metrics"])

    def metric_by_labels(self, component: str, name: str, label: str) -> dict[str, float]:
        """One metric summed over ``component``'s replicas, grouped by one label's value."""
        out: dict[str, float] = {}
        for samples in self._scrapes(component):
            for key, value in prometheus.by_label(samples, name, label).items():
                out[key] = out.get(key, 0.0) + value
        return out

    def metric_total(self, component: str, name: str, **labels: str) -> float:
        """One metric summed over ``component``'s replicas, samples matching ``labels``."""
        return sum((prometheus.value(samples, name, **labels)
                    for samples in self._scrapes(component)), 0.0)
