"""Peers of an agent: records fetched once from etcd, NIXL metadata loaded once.

``add_remote_agent`` is called once per peer *instance*: when a re-fetched record shows a
new ``instance_id`` (the peer restarted), the old metadata is dropped and the new loaded.
"""

from __future__ import annotations

import asyncio
import time

from .directory import MetadataCache
from .errors import TransferError, TransferTimeout
from .messages import AgentRecord
from .nixl_port import NixlPort


class PeerTable:
    """Owned by one KvTransferAgent; every method runs on its event loop."""

    def __init__(self, cache: MetadataCache, port: NixlPort) -> None:
        self._cache = cache
        self._port = port
        self._loaded: dict[str, str] = {}          # peer name -> instance_id loaded

    async def get(self, peer: str) -> AgentRecord:
        """The peer's record with its metadata loaded; raises PeerNotFound or
        TransferError (peer unreachable)."""
        rec, _ = await self._cache.get(peer)
        if self._loaded.get(peer) != rec.instance_id:
            if peer in self._loaded:
                self._port.remove_remote(peer)
                del self._loaded[peer]
            try:
                self._port.add_remote(rec.nixl_metadata)
            except TransferError:
                self._cache.invalidate(peer)    # maybe a dead instance; re-fetch next time
                raise
            self._loaded[peer] = rec.instance_id
        return rec

    async def refresh(self, peer: str) -> bool:
        """After a failed transfer: re-fetch; True when the peer restarted (worth a retry)."""
        old = self._loaded.get(peer)
        self._cache.invalidate(peer)
        rec = await self.get(peer)
        return rec.instance_id != old

    def expect(self, peer: str, instance_id: str) -> None:
        """A message from ``peer`` named its instance: forget stale metadata of it."""
        if self._loaded.get(peer) != instance_id:
            self._cache.invalidate(peer)

    def forget(self, peer: str) -> None:
        """Drop a peer's cached record (after a timeout: it may be gone)."""
        self._cache.invalidate(peer)


async def post_and_wait(port: NixlPort, peer: str, local, remote, mem_type: str,
                        notif: bytes, *, timeout_s: float, poll_spin_s: float,
                        poll_initial_s: float, poll_max_s: float) -> float:
    """Post one WRITE and poll it to completion without blocking the loop: for
    ``poll_spin_s`` at every turn of the loop, then with sleeps from ``poll_initial_s``
    doubling up to ``poll_max_s``.  The notification rides on the WRITE, so NIXL
    delivers it after the data on every transport.  Returns seconds from posting to
    completion; raises TransferTimeout or TransferError.  The handle is always released.
    """
    if not local:       # nothing to copy: the notification alone says "done"
        port.send(peer, notif)
        return 0.0
    t0 = time.perf_counter()
    handle, state = port.post_write(peer, local, remote, mem_type, notif)
    now = time.monotonic()
    deadline, spin_until = now + timeout_s, now + poll_spin_s
    sleep = poll_initial_s
    try:
        while state == "PROC":
            now = time.monotonic()
            if now > deadline:
                raise TransferTimeout(f"write to {peer!r} not done after {timeout_s}s")
            if now < spin_until:
                await asyncio.sleep(0)      # yield to other tasks, check again at once
            else:
                await asyncio.sleep(sleep)
                sleep = min(sleep * 2, poll_max_s)
            state = port.state(handle)
        if state != "DONE":
            raise TransferError(f"write to {peer!r} failed ({state})")
        return time.perf_counter() - t0
    finally:
        port.release(handle)
