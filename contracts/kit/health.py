"""Health of the graph's dependencies (etcd and NATS): probes and a small state tracker.

The supervisor and every component that answers readiness (the frontend) probe the same
two servers.  ``probe`` is the I/O; ``DependencyTracker`` is the pure part that turns a
series of probe results into up/down states with the time of the last change, so the
same logic runs in the supervisor, in the frontend and in unit tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

log = logging.getLogger("splitserve.infra")

DEPENDENCIES = ("etcd", "nats")


def _etcd_address(endpoint: str) -> tuple[str, str, int]:
    """The first etcd endpoint of a list: (scheme, host, port)."""
    first = endpoint.split(",")[0].strip()
    u = urlparse(first if "://" in first else f"http://{first}")
    return u.scheme, u.hostname or "127.0.0.1", u.port or 2379


def _healthy(body: bytes) -> bool:
    return b'"health":"true"' in body


def probe_etcd(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True when the first etcd endpoint answers healthy, over a new connection.

    Plain-HTTP endpoints are asked ``/health``; a TLS endpoint (which may need client
    certificates for HTTP) only has to accept a TCP connection.
    """
    scheme, host, port = _etcd_address(endpoint)
    if scheme == "https":
        return _tcp_open(host, port, timeout_s)
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout_s) as r:
            return _healthy(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False


def probe_nats(endpoint: str, timeout_s: float = 1.0) -> bool:
    """True when the first NATS server greets a new connection with its INFO line.

    NATS sends INFO in clear text before any TLS or auth handshake, so this works for
    every server configuration without credentials.
    """
    first = endpoint.split(",")[0].strip()
    u = urlparse(first if "://" in first else f"nats://{first}")
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222),
                                      timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


def _tcp_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def probe(etcd: str, nats: str, timeout_s: float = 1.0) -> dict[str, bool]:
    """Probe both dependencies once; returns ``{"etcd": bool, "nats": bool}``."""
    return {"etcd": probe_etcd(etcd, timeout_s), "nats": probe_nats(nats, timeout_s)}


class Prober:
    """``probe`` for a process that probes every half second for its whole life (the
    supervisor, the frontend): etcd is asked over one kept-alive HTTP connection.

    A new connection and urllib's machinery per probe cost the prober about 0.3 ms and
    etcd more than a kept-alive request does.  A kept connection that fails (etcd
    restarted, the connection timed out on its side) is dropped and the probe is asked
    again at once on a new one, so only a new connection's failure is a failed probe.
    NATS is still greeted on a new connection: asking anything of a kept one needs a
    CONNECT, which would need the components' credentials.  Called from one thread at a
    time.
    """

    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._at: tuple[str, int] | None = None

    def __call__(self, etcd: str, nats: str, timeout_s: float = 1.0) -> dict[str, bool]:
        return {"etcd": self.etcd(etcd, timeout_s), "nats": probe_nats(nats, timeout_s)}

    def etcd(self, endpoint: str, timeout_s: float = 1.0) -> bool:
        scheme, host, port = _etcd_address(endpoint)
        if scheme == "https":
            return _tcp_open(host, port, timeout_s)
        if self._at != (host, port):
            self.close()
        kept = self._conn is not None
        ok = self._ask(host, port, timeout_s)
        if ok is None and kept:
            ok = self._ask(host, port, timeout_s)
        return bool(ok)

    def _ask(self, host: str, port: int, timeout_s: float) -> bool | None:
        """etcd's answer over the kept connection (made if there is none); None when
        the connection failed (it is closed then)."""
        if self._conn is None:
            self._conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            self._at = (host, port)
        elif self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)
        try:
            self._conn.request("GET", "/health")
            r = self._conn.getresponse()
            body = r.read()
            if r.will_close:
                self.close()
            return r.status == 200 and _healthy(body)
        except (OSError, http.client.HTTPException):
            self.close()
            return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._at = None


@dataclass
class DependencyState:
    """What is known about one dependency."""

    name: str
    up: bool = True
    since: float = 0.0
    failures: int = 0
    restarts: int = 0

    def as_dict(self, now: float) -> dict:
        return {"name": self.name, "state": "up" if self.up else "down",
                "for_s": round(max(0.0, now - self.since), 1), "restarts": self.restarts}


class DependencyTracker:
    """Turns probe results into up/down states.

    A dependency goes down after ``down_after`` consecutive failed probes (one by
    default: a refused connection on loopback is not a blip) and up again on the first
    good probe.  ``update`` returns the names whose state changed, for logging.
    """

    def __init__(self, names: tuple[str, ...] = DEPENDENCIES, down_after: int = 1,
                 now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self.states = {n: DependencyState(n, since=t) for n in names}
        self.down_after = max(1, down_after)

    def update(self, results: dict[str, bool], now: float | None = None) -> list[str]:
        """Record one probe round; returns the dependencies whose state flipped."""
        t = time.monotonic() if now is None else now
        changed = []
        for name, ok in results.items():
            st = self.states.get(name)
            if st is None:
                continue
            st.failures = 0 if ok else st.failures + 1
            up = ok or (st.up and st.failures < self.down_after)
            if up != st.up:
                st.up, st.since = up, t
                changed.append(name)
        return changed

    def mark_down(self, name: str, now: float | None = None) -> bool:
        """Record a dependency as down without a probe (its process exited); True if new."""
        st = self.states[name]
        if not st.up:
            return False
        st.up, st.since = False, time.monotonic() if now is None else now
        st.failures = max(st.failures, self.down_after)
        return True

    def down(self) -> list[str]:
        """Names of the dependencies that are down now, in a stable order."""
        return [n for n, s in self.states.items() if not s.up]

    def rows(self, now: float | None = None) -> list[dict]:
        t = time.monotonic() if now is None else now
        return [s.as_dict(t) for s in self.states.values()]


class DependencyMonitor:
    """Probes etcd and NATS in the background for a component process.

    ``down()`` is what the frontend's readiness and error mapping consult; it costs
    nothing (the probes run in a thread every ``interval_s``).
    """

    def __init__(self, etcd: str, nats: str, interval_s: float = 0.5,
                 prober: Callable[[str, str], dict[str, bool]] | None = None) -> None:
        self.etcd, self.nats = etcd, nats
        self.interval_s = interval_s
        self.prober = prober if prober is not None else Prober()
        self.tracker = DependencyTracker()
        self._task: asyncio.Task | None = None

    def down(self) -> list[str]:
        return self.tracker.down()

    async def poll_once(self) -> list[str]:
        """One probe round (called by the loop; tests call it directly)."""
        results = await asyncio.to_thread(self.prober, self.etcd, self.nats)
        changed = self.tracker.update(results)
        for name in changed:
            log.warning("dependency %s is %s", name, "up again" if results[name] else "down")
        return changed

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.poll_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
