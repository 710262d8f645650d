"""One graph over several hosts: which part of a plan this host runs, and where it listens.

``dynamo serve GRAPH -f CONFIG --only DecodeWorker --etcd URL --nats URL`` runs only the
named components of the graph on this host; the other hosts run the rest with the same
config against the same etcd and NATS, and Dynamo's discovery joins them.  The functions
here are pure (the CLI and the supervisor call them with what they read):

- ``select_components`` restricts a plan to the named components;
- ``host_checks`` refuses a spread graph that could not work: no shared etcd/NATS, or
  listeners on loopback while the servers (hence the other hosts) are elsewhere;
- ``ucx_device`` names the network interface that holds ``Common.bind_host``, so UCX
  (NIXL's transport) listens on that address only.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from splitserve.contracts.config import CommonConfig, ConfigError
from splitserve.contracts.kit.listeners import is_loopback, listener_env
from splitserve.serve.plan import ServePlan


def select_components(plan: ServePlan, only: Sequence[str]) -> ServePlan:
    """``plan`` with only the components named in ``only`` (``dynamo serve --only``).

    A name is a component as the status table shows it (``DecodeWorker``,
    ``Worker@qwen`` for a model pool's copy), or a graph component's name, which takes
    its copy in every pool too.  The components keep their links: what they call runs
    on other hosts and is found through discovery.  Raises ConfigError naming
    ``--only`` and listing the valid names for an unknown or empty selection."""
    names = [n.strip() for n in only if n.strip()]
    valid = [c.name for c in plan.components]
    unknown = [n for n in names if n not in valid
               and not any(c.component == n for c in plan.components)]
    if not names or unknown:
        what = (f"unknown component {', '.join(repr(n) for n in unknown)}" if unknown
                else "names no component")
        raise ConfigError(plan.source, [f"--only: {what} of {plan.graph_ref} (its "
                                        f"components: {', '.join(valid)})"])
    chosen = [c for c in plan.components if c.name in names or c.component in names]
    return dataclasses.replace(plan, components=chosen, only=[c.name for c in chosen])


def _hosts(urls: str) -> list[str]:
    """Host part of each comma-separated URL (``http://10.0.0.1:2379,...``)."""
    return [urlsplit(u.strip() if "://" in u else f"//{u.strip()}").hostname or ""
            for u in urls.split(",") if u.strip()]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: another host as far as we can tell


def host_checks(common: CommonConfig, etcd: str | None, nats: str | None) -> list[str]:
    """Why a part of a graph (``--only``) cannot run on this host as configured; empty
    when it can.  Called by the CLI before anything starts.

    A spread graph needs the etcd and NATS every host uses (``--etcd``/``--nats``): the
    embedded servers listen on 127.0.0.1, where no other host reaches them.  With
    those on another host, ``Common.bind_host`` must be this host's address: Dynamo
    registers the address a listener binds, and the other hosts connect to it (the
    frontend's response streams, the workers' request plane, the KV agents' UCX)."""
    if not (etcd and nats):
        return ["--only: runs part of a graph against the etcd and NATS that the other "
                "hosts use; give --etcd and --nats (embedded servers listen on 127.0.0.1, "
                "where no other host reaches them)"]
    remote = [h for h in _hosts(etcd) + _hosts(nats) if not _is_loopback(h)]
    if remote and _is_loopback(common.bind_host):
        return [f"Common.bind_host: {common.bind_host} is loopback, but etcd/NATS run on "
                f"{', '.join(sorted(set(remote)))}: the other hosts could not reach this "
                "host's listeners; set --Common.bind_host=<this host's address>"]
    return []


def ucx_device(bind_host: str, interfaces: Mapping[str, Iterable[str]]) -> str | None:
    """The interface whose addresses include ``bind_host`` (``interfaces``: name ->
    its addresses), or None when no interface holds it.  UCX's TCP transport listens on
    every address of the devices it is given: limited to this one, it listens on
    ``bind_host`` and on nothing else."""
    want = ipaddress.ip_address(bind_host)
    for name, addrs in interfaces.items():
        for a in addrs:
            try:
                if ipaddress.ip_address(a.split("%", 1)[0]) == want:
                    return name
            except ValueError:
                continue
    return None


def local_interfaces() -> dict[str, list[str]]:
    """This host's network interfaces and their addresses (Linux: each interface's
    primary IPv4 address and its IPv6 addresses); read by the supervisor at start."""
    import socket

    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        out[name] = _addresses(name)
    return out


def _addresses(name: str) -> list[str]:
    """IPv4 address (SIOCGIFADDR) and IPv6 addresses (/proc/net/if_inet6) of ``name``."""
    import fcntl
    import socket
    import struct

    addrs: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = struct.pack("256s", name.encode()[:15])
            addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))
        except OSError:
            pass  # no IPv4 address
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                cols = line.split()
                if len(cols) == 6 and cols[5] == name:
                    addrs.append(str(ipaddress.IPv6Address(bytes.fromhex(cols[0]))))
    except OSError:
        pass
    return addrs


def host_listener_env(bind_host: str,
                      interfaces: Mapping[str, Iterable[str]] | None = None) -> dict[str, str]:
    """The listener variables every replica of this host gets (``listener_env``), with
    UCX limited to the interface that holds ``bind_host`` when it is not loopback
    (``interfaces``: None reads this host's).  Without that UCX is given every device
    and its TCP transport listens on each of their addresses, loopback included; when
    no interface holds the address (a NAT'd advertise address, say) it keeps them all.
    A component's ``env: {UCX_NET_DEVICES: ...}`` still wins (an RDMA device)."""
    env = listener_env(bind_host)
    if not is_loopback(bind_host):
        device = ucx_device(bind_host, local_interfaces() if interfaces is None
                            else interfaces)
        if device is not None:
            env["UCX_NET_DEVICES"] = device
    return env
