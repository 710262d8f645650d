"""The only module that calls NIXL: a thin, synchronous wrapper over ``nixl_agent``.

Every call here returns quickly (posting, checking, draining); waiting is done by the
caller with asyncio sleeps, so nothing blocks the event loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from .descriptors import Desc
from .errors import TransferError

log = logging.getLogger(__name__)


class NixlPort:
    """One NIXL agent with one backend; created by KvTransferAgent, closed with it."""

    def __init__(self, name: str, backend: str, *, progress_thread: bool = False) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        # UCX's TCP transport listens on every interface's address unless limited to
        # devices.  A component process sets UCX_NET_DEVICES from Common.bind_host ("lo",
        # or "all" for a multi-node graph) before its runtime starts; a process started
        # any other way stays on loopback.  UCX reads it when the agent below
        # initialises its context.
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.name = name
        self.backend = backend
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend])
        self._agent = nixl_agent(name, conf)
        if backend not in self._agent.backends:
            raise TransferError(f"NIXL backend {backend!r} unavailable; plugins: "
                                f"{self._agent.get_plugin_list()}")
        self._regs: list[Any] = []
        self._remotes: set[str] = set()

    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor once, at start; deregistered by :meth:`close`."""
        self._regs.append(self._agent.register_memory(tensor, backends=[self.backend]))

    def metadata(self) -> bytes:
        """This agent's metadata blob; call after every registration."""
        return self._agent.get_agent_metadata()

    def add_remote(self, blob: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        try:
            name = self._agent.add_remote_agent(blob)
        except Exception as exc:  # e.g. the peer's UCX address is gone
            raise TransferError(f"cannot connect to the peer: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (before loading its newer metadata, or at close)."""
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                log.debug("remove_remote_agent(%s): %s", name, exc)

    def post_write(self, peer: str, local: Sequence[Desc], remote: Sequence[Desc],
                   mem_type: str, notif: bytes) -> tuple[Any, str]:
        """Create and post a WRITE of ``local[i] -> remote[i]`` with ``notif`` delivered
        to the peer after the data.  Returns (handle, "DONE" | "PROC" | "ERR")."""
        local_d = self._agent.get_xfer_descs(list(local), mem_type)
        remote_d = self._agent.get_xfer_descs(list(remote), mem_type)
        try:
            handle = self._agent.initialize_xfer("WRITE", local_d, remote_d, peer, notif,
                                                 backends=[self.backend])
        except Exception as exc:  # nixlNotFoundError etc.
            raise TransferError(f"cannot create a write to {peer!r}: {exc}") from exc
        try:
            return handle, self._agent.transfer(handle)
        except Exception as exc:  # nixlRemoteDisconnectError when it died
            self.release(handle)
            raise TransferError(f"cannot post a write to {peer!r}: {exc}") from exc

    def state(self, handle: Any) -> str:
        """"DONE", "PROC" or "ERR" of a posted transfer."""
        return self._agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        """Free a transfer handle; a transfer still in flight is aborted if NIXL can."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - release of an unfinished transfer
            log.warning("could not release a transfer handle: %s", exc)

    def send(self, peer: str, msg: bytes) -> None:
        """A standalone notification (not bound to a transfer)."""
        try:
            self._agent.send_notif(peer, msg)
        except Exception as exc:
            raise TransferError(f"cannot notify {peer!r}: {exc}") from exc

    def drain(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (sender name, bytes)."""
        out = []
        for peer, msgs in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((peer, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        """Forget peers and deregister memory; the NIXL agent itself goes with the object."""
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg, backends=[self.backend])
            except Exception as exc:  # noqa: BLE001 - best effort at close
                log.warning("deregister_memory failed: %s", exc)
        self._regs.clear()
