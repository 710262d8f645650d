"""Several hosts on one machine: Linux network namespaces joined by a bridge.

``Hosts`` creates one namespace per host name, each with loopback up and one veth into
a bridge with a private /24 of its own; the test process (the client) gets an address
on the same bridge, so it reaches every host as a client on the network would.  Each
namespace has its own listeners, routes and links: a process there can bind only its
own address and loopback, and taking its link down cuts it off as a cable would.
``close`` deletes everything it created (deleting a namespace removes its veth end, and
the bridge lives in the first host's namespace), so a failed test leaves nothing behind.
Needs root and iproute2's ``ip netns``; ``available`` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "needs iproute2's ip and ss"
    probe = f"ssmh-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def ip(*args: str, ns: str | None = None) -> None:
    """Run ``ip ARGS`` (in namespace ``ns``); raises with ip's message on failure."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


@dataclass
class Hosts:
    """Namespaces named after ``names`` on one bridge; addresses 10.213.<net>.<1..n>,
    the client's 10.213.<net>.254."""

    names: tuple[str, ...]
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    net: int = field(default_factory=lambda: 20 + os.getpid() % 200)
    made: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"ssmh{self.tag}{host}"

    def addr(self, host: str) -> str:
        return f"10.213.{self.net}.{self.names.index(host) + 1}"

    @property
    def client_addr(self) -> str:
        return f"10.213.{self.net}.254"

    def dev(self, host: str) -> str:
        """The host's interface (its end of the veth), inside its namespace."""
        return f"eth-{host}"[:15]

    def _peer(self, host: str) -> str:
        return f"sm{self.tag}{host}"[:15]

    def up(self) -> Hosts:
        """Create the namespaces, the bridge (in the first host's namespace) and links."""
        hub = self.ns(self.names[0])
        for host in self.names:
            ip("netns", "add", self.ns(host))
            self.made.append(self.ns(host))
            ip("link", "set", "lo", "up", ns=self.ns(host))
        ip("link", "add", "br0", "type", "bridge", ns=hub)
        ip("link", "set", "br0", "up", ns=hub)
        for host in self.names:
            peer = self._peer(host)
            # created in place: the host's end in its namespace, the bridge's in the hub
            ip("link", "add", peer, "netns", hub, "type", "veth", "peer", "name",
               self.dev(host), "netns", self.ns(host))
            ip("link", "set", peer, "master", "br0", ns=hub)
            ip("link", "set", peer, "up", ns=hub)
            ip("addr", "add", f"{self.addr(host)}/24", "dev", self.dev(host), ns=self.ns(host))
            ip("link", "set", self.dev(host), "up", ns=self.ns(host))
        # The client: a veth from this process's namespace into the bridge.
        client, port = f"sm{self.tag}cl"[:15], f"sm{self.tag}cp"[:15]
        ip("link", "add", client, "type", "veth", "peer", "name", port, "netns", hub)
        self.made.append(client)
        ip("link", "set", port, "master", "br0", ns=hub)
        ip("link", "set", port, "up", ns=hub)
        ip("addr", "add", f"{self.client_addr}/24", "dev", client)
        ip("link", "set", client, "up")
        return self

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: the
        process keeps the pid the caller sees)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def link(self, host: str, up: bool) -> None:
        """Plug or unplug ``host``'s cable (its interface up or down)."""
        ip("link", "set", self.dev(host), "up" if up else "down", ns=self.ns(host))

    def listeners(self, host: str) -> list[tuple[str, int, list[int]]]:
        """Every listening TCP socket in ``host``'s namespace: (address, port, pids), from
        ``ss -ltnpH``."""
        out = subprocess.run(["ip", "netns", "exec", self.ns(host), "ss", "-ltnpH"],
                             capture_output=True, text=True, check=True).stdout
        return [parse_ss_line(line) for line in out.splitlines() if line.strip()]

    def close(self) -> None:
        """Delete what ``up`` made (every namespace, the client's veth); errors ignored:
        it runs after failures too."""
        for name in reversed(self.made):
            if name.startswith("ssmh"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        self.made.clear()


def parse_ss_line(line: str) -> tuple[str, int, list[int]]:
    """One line of ``ss -ltnpH`` as (address, port, pids).

    ``LISTEN 0 4096 10.0.0.1:2379 0.0.0.0:* users:(("etcd",pid=7,fd=8))``; IPv6 addresses
    come in brackets (``[::]:80``), a wildcard as ``*:80`` or ``0.0.0.0:80``, an address
    bound to a device as ``10.0.0.1%eth0:80``."""
    cols = line.split()
    local = cols[3]
    host, _, port = local.rpartition(":")
    host = host.strip("[]").split("%", 1)[0]
    if host == "*":
        host = "0.0.0.0"
    pids = [int(p.split(",", 1)[0]) for p in line.split("pid=")[1:]]
    return host, int(port), pids
