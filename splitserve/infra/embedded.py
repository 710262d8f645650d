"""Embedded etcd and NATS (JetStream on) for a local graph.

``dynamo serve`` starts these when no external endpoints are configured; ``dynamo infra``
starts them for development.  Both servers bind 127.0.0.1 on free ports with their data
under a per-run directory, so two runs on one machine never collide.
"""

from __future__ import annotations

import http.client
import logging
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from splitserve.contracts.kit.files import write_json_whole
from splitserve.contracts.kit.procs import find_binary, free_port, spawn, terminate

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


@dataclass(frozen=True)
class InfraEndpoints:
    """Where components find discovery (etcd) and messaging (NATS)."""

    etcd: str
    nats: str
    embedded: bool

    def env(self) -> dict[str, str]:
        """The environment variables Dynamo's runtime and our components read."""
        return {"ETCD_ENDPOINTS": self.etcd, "NATS_SERVER": self.nats}


def resolve_endpoints(etcd: str | None, nats: str | None) -> InfraEndpoints | None:
    """Decide between external and embedded infrastructure.

    Called by the CLI with values from flags or the environment.  Returns the external
    endpoints when both are given, None when neither is (start embedded servers), and
    raises ValueError when only one is: half-external infrastructure is a mistake.
    """
    if etcd and nats:
        return InfraEndpoints(etcd=etcd, nats=nats, embedded=False)
    if not etcd and not nats:
        return None
    missing = "NATS_SERVER / --nats" if etcd else "ETCD_ENDPOINTS / --etcd"
    raise ValueError(f"only one of etcd and NATS is configured; also set {missing} "
                     "or set neither to start embedded servers")


class InfraStartError(RuntimeError):
    """An embedded server failed to become healthy; the message holds its log tail."""


@dataclass
class _Server:
    name: str
    argv: list[str]
    health_url: str
    healthy_body: str
    log_path: Path
    proc: object = None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=0.5) as resp:
                return self.healthy_body in resp.read().decode()
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
            # HTTPException: another server holds the port (another graph's NATS took it
            # in a port race); ours then fails to bind and start() retries on new ports.
            return False

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class EmbeddedInfra:
    """Starts etcd and nats-server as child processes and stops them.

    Use as a context manager or call ``start()`` / ``stop()``.  ``start()`` blocks until
    both servers answer their health endpoints or raises InfraStartError.
    """

    def __init__(self, run_dir: Path, *, start_timeout_s: float = 20.0,
                 detached: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.detached = detached
        self.start_timeout_s = start_timeout_s
        self.endpoints: InfraEndpoints | None = None
        self._servers: list[_Server] = []
        self.ports: dict[str, int] = {}

    def _plan(self) -> list[_Server]:
        p = {k: free_port(HOST) for k in ("etcd_client", "etcd_peer", "nats", "nats_monitor")}
        self.ports = p
        etcd_dir = self.run_dir / "etcd"
        nats_dir = self.run_dir / "nats"
        for d in (etcd_dir, nats_dir):
            d.mkdir(parents=True, exist_ok=True)
        client = f"http://{HOST}:{p['etcd_client']}"
        peer = f"http://{HOST}:{p['etcd_peer']}"
        etcd = _Server(
            "etcd",
            [find_binary("etcd"), "--name", "splitserve", "--data-dir", str(etcd_dir / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"splitserve={peer}", "--log-level", "warn"],
            f"{client}/health", '"health":"true"', self.run_dir / "etcd.log")
        nats = _Server(
            "nats",
            [find_binary("nats-server"), "-a", HOST, "-p", str(p["nats"]), "-js",
             "-sd", str(nats_dir), "-m", str(p["nats_monitor"])],
            f"http://{HOST}:{p['nats_monitor']}/healthz", '"ok"', self.run_dir / "nats.log")
        self.endpoints = InfraEndpoints(etcd=client, nats=f"nats://{HOST}:{p['nats']}",
                                        embedded=True)
        return [etcd, nats]

    def start(self, attempts: int = 3) -> InfraEndpoints:
        """Start both servers and wait for health; retries with new ports on a port race."""
        last: Exception | None = None
        for _ in range(attempts):
            try:
                return self._start_once()
            except InfraStartError as exc:
                last = exc
                self.stop()
                if "address already in use" not in str(exc):
                    break
        raise last  # type: ignore[misc]

    def _start_once(self) -> InfraEndpoints:
        self._servers = self._plan()
        for srv in self._servers:
            with open(srv.log_path, "ab") as logf:
                srv.proc = spawn(srv.argv, stdout=logf, stderr=logf,
                                 die_with_parent=not self.detached)
            log.debug("started %s pid=%s", srv.name, srv.proc.pid)
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(self._servers)
        while pending:
            for srv in list(pending):
                if srv.proc.poll() is not None:
                    raise InfraStartError(f"{srv.name} exited with {srv.proc.returncode}:\n"
                                          f"{srv.log_tail()}")
                if srv.healthy():
                    pending.remove(srv)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise InfraStartError(f"{names} not healthy after {self.start_timeout_s}s:\n"
                                      + "\n".join(s.log_tail() for s in pending))
            if pending:
                time.sleep(0.05)
        assert self.endpoints is not None
        self.write_state(self.run_dir / "infra.json")
        return self.endpoints

    def pids(self) -> dict[str, int]:
        """Pid of each running server by name."""
        return {s.name: s.proc.pid for s in self._servers if s.proc is not None}

    def exited(self) -> dict[str, int]:
        """Servers whose process has exited, with their exit code.

        Polling reaps the child, so a killed server never lingers as a zombie.  Called by
        the supervisor's dependency watch a few times a second.
        """
        return {s.name: s.proc.returncode for s in self._servers
                if s.proc is not None and s.proc.poll() is not None}

    def restart(self, name: str, timeout_s: float | None = None) -> int:
        """Start server ``name`` again with its original arguments and wait for health.

        Same ports and data directory as before, so clients reconnect to the address they
        know and etcd keeps its keys and leases, JetStream its streams.  Returns the new
        pid; raises InfraStartError (with the log tail) if it does not become healthy.
        """
        srv = next(s for s in self._servers if s.name == name)
        if srv.proc is not None and srv.proc.poll() is None:
            terminate(srv.proc, 2.0)
        with open(srv.log_path, "ab") as logf:
            srv.proc = spawn(srv.argv, stdout=logf, stderr=logf,
                             die_with_parent=not self.detached)
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while not srv.healthy():
            if srv.proc.poll() is not None:
                raise InfraStartError(f"{name} exited with {srv.proc.returncode} on restart:\n"
                                      f"{srv.log_tail()}")
            if time.monotonic() > deadline:
                raise InfraStartError(f"{name} not healthy after restart:\n{srv.log_tail()}")
            time.sleep(0.05)
        self.write_state(self.run_dir / "infra.json")
        log.info("restarted %s pid=%s", name, srv.proc.pid)
        return srv.proc.pid

    def write_state(self, path: Path) -> None:
        """Record endpoints, ports and pids so `dynamo infra down|status` can find them."""
        state = {"endpoints": asdict(self.endpoints), "ports": self.ports, "pids": self.pids(),
                 "run_dir": str(self.run_dir)}
        write_json_whole(path, state, indent=2)

    def stop(self, grace_s: float = 5.0) -> dict[str, int | None]:
        """Stop NATS, then etcd (components may still deregister until the very end)."""
        codes: dict[str, int | None] = {}
        for srv in reversed(self._servers):
            if srv.proc is not None:
                codes[srv.name] = terminate(srv.proc, grace_s)
        self._servers = []
        return codes

    def __enter__(self) -> InfraEndpoints:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def check_health(endpoints: InfraEndpoints, timeout_s: float = 1.0) -> dict[str, bool]:
    """Probe etcd's /health and the NATS server's greeting; used by status commands."""
    from splitserve.contracts.kit.health import probe

    return probe(endpoints.etcd, endpoints.nats, timeout_s)
