"""One listening socket shared by every replica of the graph's HTTP frontend.

The supervisor binds the frontend's address once (``bind_listener``), before any replica
starts, and hands the socket to each replica it spawns (``LISTEN_FD_VAR``).  Every
replica accepts from the same socket, so ``Frontend.replicas`` above 1 on one host
serves one port with several processes (one event loop, one interpreter lock each),
the kernel waking whichever replica is free to accept; a busy address is reported once,
by the supervisor, naming the field.

The socket outlives its replicas: a connection that arrives while a replica restarts,
or while one of several drains, waits in the accept queue for the next replica to
accept it instead of being refused or reset.  Hence two rules for a replica:

- it accepts only when it can answer, unless it is its component's only replica
  (``LISTEN_EARLY_VAR``), which accepts while loading and answers 503 ``not_ready`` as
  a frontend that binds its own socket does;
- on stop it only stops accepting: the drop filter (``stop_accepting_new``) is the
  supervisor's to attach, once, when the whole graph stops, since a filter on the shared
  socket would turn away its siblings' connections too.

``stop_accepting_new`` (the drop filter, then waiting for the accept queue to empty) is
used by both the supervisor and a frontend that binds its own socket.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.contracts.kit.waiting import poll_until

log = logging.getLogger(__name__)

LISTEN_FD_VAR = "SPLITSERVE_LISTEN_FD"
"""The inherited socket's file descriptor in a replica's environment."""
LISTEN_EARLY_VAR = "SPLITSERVE_LISTEN_EARLY"
"""Set (to 1) for a component's only replica: it accepts while it loads."""
BACKLOG = 2048


def bind_listener(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port) that children inherit;
    raises OSError (the address is busy, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class InheritedListener:
    """The socket a replica was handed, and whether it may accept while loading."""

    sock: socket.socket
    early: bool

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]


def inherited_listener(environ: Mapping[str, str] = os.environ) -> InheritedListener | None:
    """The listening socket the supervisor handed this process, or None (it binds its own,
    e.g. started without the supervisor).  Raises ValueError for a descriptor that is not
    a listening TCP socket."""
    raw = environ.get(LISTEN_FD_VAR)
    if not raw:
        return None
    try:
        sock = socket.socket(fileno=int(raw))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{LISTEN_FD_VAR}={raw!r} is not an open socket: {exc}") from None
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET,
                                                             socket.SO_ACCEPTCONN):
        sock.detach()
        raise ValueError(f"{LISTEN_FD_VAR}={raw!r} is not a listening TCP socket")
    sock.set_inheritable(False)  # this replica's own children must not hold it
    return InheritedListener(sock, early=environ.get(LISTEN_EARLY_VAR) == "1")


# SO_ATTACH_FILTER (asm-generic) with a one-instruction classic BPF program, "return 0":
# every packet to the socket is dropped, a listener's SYNs included.
SO_ATTACH_FILTER = 26
_BPF_RET_K = 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def refuse_new_connections(fd: int) -> bool:
    """Make the listening socket ``fd`` drop new connection attempts (Linux); what its
    accept queue holds stays there to be accepted.  A client whose SYN was dropped sends
    it again about a second later.  Returns False where this is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    drop_all = _SockFilter(_BPF_RET_K, 0, 0, 0)
    prog = _SockFprog(1, ctypes.pointer(drop_all))
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(prog))
    except OSError as exc:
        log.debug("cannot stop new connections on fd %d: %s", fd, exc)
        return False
    return True


def accept_queue_length(fd: int) -> int:
    """Connections waiting in the accept queue of the listening socket ``fd`` (Linux:
    ``tcpi_unacked`` of a listener); 0 where unknown."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
    except (OSError, AttributeError):
        return 0
    return struct.unpack_from("I", info, 24)[0] if len(info) >= 28 else 0


async def stop_accepting_new(fds: list[int], timeout_s: float) -> None:
    """Drop new connection attempts to the listening sockets ``fds`` and wait, at most
    ``timeout_s``, until whoever accepts from them has taken what their accept queues
    held: closing a listener resets every connection still queued on it."""
    fds = [fd for fd in fds if refuse_new_connections(fd)]
    if fds:
        await poll_until(lambda: not any(accept_queue_length(fd) for fd in fds), timeout_s,
                         poll_s=0.005)
