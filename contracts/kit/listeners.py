"""Where the graph's processes listen: one address for every listener.

Dynamo's runtime and UCX pick the machine's external address unless told otherwise,
so the supervisor gives every replica the variables below, all derived from
``Common.bind_host`` (127.0.0.1 by default), and a component process started without
the supervisor (a Kubernetes pod) derives the ones it lacks from its own bind host
(``--bind-host``).  Checked on a running disaggregated graph with ``ss -ltnp``: with
these set, every socket of every replica is on loopback.

Dynamo 1.6.1 has no separate advertise address for these listeners: it registers the
address it binds, so a peer reaches them at ``bind_host`` (hence no wildcards).
``Common.advertise_host`` only names the engines' own listeners in handoffs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

# Dynamo 1.6.1 runtime: request-plane server, response-stream server (every client
# process has one), system status/metrics server, ZMQ event plane, HTTP request plane.
DYNAMO_HOST_VARS = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_SYSTEM_HOST",
                    "DYN_EVENT_PLANE_HOST", "DYN_HTTP_RPC_HOST")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8 or ::1)."""
    return ipaddress.ip_address(host).is_loopback


def listener_env(bind_host: str) -> dict[str, str]:
    """Environment that makes a replica's listeners bind ``bind_host``.

    On loopback, UCX (NIXL's transport) is limited to the ``lo`` device: its TCP
    transport otherwise listens on every interface's address.  On another address UCX
    gets all devices (RDMA included; the KV agent's own default is loopback); restrict
    them with ``UCX_NET_DEVICES`` in the component's ``env`` if needed.
    """
    env = {name: bind_host for name in DYNAMO_HOST_VARS}
    env["UCX_NET_DEVICES"] = "lo" if is_loopback(bind_host) else "all"
    return env


def missing_listener_env(bind_host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``listener_env(bind_host)`` that ``environ`` does not set.

    Called by a component process just before it starts Dynamo's runtime, with its
    ``Common.bind_host`` (after ``--bind-host``); it sets what this returns.  A variable
    already set wins: the supervisor's (derived from the same bind host), or one a
    component's ``env:`` section or a manifest gives on purpose.
    """
    return {k: v for k, v in listener_env(bind_host).items() if k not in environ}
