"""``KvTransferAgent``: one worker's NIXL agent, its registered KV pool and its peers.

Prefill side: ``write_blocks`` copies blocks of its pool straight into a decode worker's
blocks (direct path) or into the decode worker's staging pool (staged path, when the
layouts differ), with the arrival notification attached to the write.  Decode side:
``wait_for`` / ``poll_notifications`` learn that a request's KV is in place; staged
payloads are rebuilt into the pool before that.  See docs/kv_transfer.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import NamedTuple, Self

import torch

from .config import KvTransferConfig
from .descriptors import check_block_ids, merge_runs, run_descs, staged_runs
from .directory import AgentDirectory, MetadataCache
from .errors import StagingFull, TransferError, TransferTimeout
from .inbox import Arrival, Inbox
from .layout import PoolLayout, dst_blocks_needed, needed_src_ranks, plan_transform
from .messages import (
    AgentRecord,
    KvArrived,
    Region,
    StagedInfo,
    StageGrant,
    StageRequest,
    decode,
    encode,
)
from .nixl_port import NixlPort
from .payload import build_fp8, staged_nbytes
from .peers import PeerTable, post_and_wait
from .staging import StagingAllocator

log = logging.getLogger(__name__)


class WriteResult(NamedTuple):
    """What one ``write_blocks`` did; the numbers feed logs and benchmarks."""

    path: str          # "direct", "staged" or "skipped" (this rank's heads are not needed)
    nbytes: int        # bytes on the wire
    descriptors: int   # descriptors after merging runs
    seconds: float     # from posting to completion


class KvTransferAgent:
    """Create, ``await start()`` (publishes the record), use, ``await close()``."""

    def __init__(self, name: str, pool: torch.Tensor, backend: str | None = None, *,
                 etcd_endpoints: str, config: KvTransferConfig | None = None,
                 tp_size: int = 1, tp_rank: int = 0,
                 total_kv_heads: int | None = None) -> None:
        config = config or KvTransferConfig()
        if backend is not None:     # the argument wins over the config; resolved once here
            config = config.model_copy(update={"backend": backend})
        self.config = config
        self.name = name
        self.pool = pool
        self.layout = PoolLayout.of_pool(pool, tp_size=tp_size, tp_rank=tp_rank,
                                         total_kv_heads=total_kv_heads)
        self._mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        self._device_id = max(pool.get_device(), 0)
        self._port = NixlPort(name, config.backend, progress_thread=config.progress_thread)
        self._port.register(pool)
        self._staging: torch.Tensor | None = None
        self._alloc: StagingAllocator | None = None
        if config.staging_bytes:
            self._staging = torch.empty(config.staging_bytes, dtype=torch.uint8,
                                        device=pool.device)
            self._port.register(self._staging)
            self._alloc = StagingAllocator(config.staging_bytes, config.staging_align)
        self._inbox = Inbox(pool, self.layout, self._staging, self._alloc)
        self._directory = AgentDirectory(etcd_endpoints, config.namespace)
        self._cache = MetadataCache(self._directory)
        self._peers = PeerTable(self._cache, self._port)
        self._replies: list[tuple[str, str, StageGrant]] = []
        self._poller: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None  # made on the poller's loop
        self._busy_until = 0.0
        self.instance_id = uuid.uuid4().hex

    # ------------------------------------------------------------------ lifecycle
    def record(self) -> AgentRecord:
        """This agent's etcd record (pool address, layout, NIXL metadata)."""
        staging = None if self._staging is None else self._region(self._staging)
        return AgentRecord(name=self.name, instance_id=self.instance_id,
                           backend=self.config.backend, pool=self._region(self.pool),
                           block_bytes=self.layout.block_bytes, num_blocks=self.pool.shape[0],
                           layout=self.layout, staging=staging,
                           nixl_metadata=self._port.metadata())

    def _region(self, t: torch.Tensor) -> Region:
        return Region(base_addr=t.data_ptr(), nbytes=t.numel() * t.element_size(),
                      mem_type=self._mem_type, device_id=self._device_id)

    async def start(self) -> AgentRecord:
        """Called once after creation: publishes the record so peers can find us."""
        rec = self.record()
        await self._directory.publish(rec)
        return rec

    async def close(self) -> None:
        """Stop the poller, remove our record, forget peers, deregister memory."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        try:
            await self._directory.remove(self.name, self.instance_id)
        except Exception as exc:  # noqa: BLE001 - etcd may already be gone at shutdown
            log.warning("could not remove agent record %s: %s", self.name, exc)
        self._port.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ peers
    # ------------------------------------------------------------------ sending
    async def write_blocks(self, peer: str, src_block_ids: Sequence[int],
                           dst_block_ids: Sequence[int], notify: bytes = b"", *,
                           request_id: str, num_tokens: int | None = None) -> WriteResult:
        """Prefill side, once per request: copy ``src_block_ids`` of our pool into the
        peer's ``dst_block_ids`` and notify it with ``notify``.

        ``num_tokens`` (default: all slots of the source blocks) matters only when the
        block sizes differ.  Returns a WriteResult; raises TransferTimeout, PeerNotFound,
        StagingFull or TransferError, after which the decode side prefills locally.
        """
        check_block_ids(src_block_ids, self.pool.shape[0], "source")
        for attempt in (0, 1):
            rec = await self._peers.get(peer)
            try:
                return await self._write_once(peer, rec, src_block_ids, dst_block_ids, notify,
                                              request_id, num_tokens)
            except TransferTimeout:
                self._peers.forget(peer)        # it may be gone: re-fetch next time
                raise
            except StagingFull:
                raise
            except TransferError:
                # a restarted peer has a new record: rebuild descriptors from it, once
                if attempt or not await self._peers.refresh(peer):
                    raise
                log.info("peer %s restarted; retrying with its new metadata", peer)
        raise AssertionError("unreachable")

    async def _write_once(self, peer, rec, src_ids, dst_ids, notify, request_id,
                          num_tokens) -> WriteResult:
        plan = plan_transform(self.layout, rec.layout)
        if plan.path == "direct" and not self.config.force_staged:
            check_block_ids(dst_ids, rec.num_blocks, "destination")
            local, remote = run_descs(merge_runs(src_ids, dst_ids),
                                      src_base=self.pool.data_ptr(),
                                      dst_base=rec.pool.base_addr,
                                      block_bytes=self.layout.block_bytes,
                                      src_device=self._device_id,
                                      dst_device=rec.pool.device_id)
            msg = KvArrived(request_id=request_id, payload=notify)
            return await self._send(peer, local, remote, encode(msg), "direct")
        if self.layout.tp_rank not in needed_src_ranks(self.layout, rec.layout):
            return WriteResult("skipped", 0, 0, 0.0)
        return await self._write_staged(peer, rec, src_ids, dst_ids, notify, request_id,
                                        num_tokens)

    async def _write_staged(self, peer, rec, src_ids, dst_ids, notify, request_id,
                            num_tokens) -> WriteResult:
        n = len(src_ids)
        num_tokens = n * self.layout.block_size if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= n * self.layout.block_size:
            raise ValueError(f"num_tokens {num_tokens} does not fit {n} source blocks")
        if len(dst_ids) != dst_blocks_needed(num_tokens, rec.layout):
            raise ValueError(f"{num_tokens} tokens need {dst_blocks_needed(num_tokens, rec.layout)}"
                             f" receiver blocks, got {len(dst_ids)}")
        check_block_ids(dst_ids, rec.num_blocks, "destination")
        if rec.staging is None:
            raise StagingFull(f"peer {peer!r} has no staging pool; layouts differ")
        fp8 = self.config.fp8
        nbytes = staged_nbytes(self.layout, n, fp8)
        offset = await self._request_staging(peer, request_id, nbytes)
        info = StagedInfo(offset=offset, nbytes=nbytes, src_layout=self.layout,
                          num_src_blocks=n, num_tokens=num_tokens,
                          dst_block_ids=list(dst_ids), fp8=fp8)
        msg = encode(KvArrived(request_id=request_id, payload=notify, staged=info))
        remote_base = rec.staging.base_addr + offset
        if not fp8:
            local, remote = run_descs(staged_runs(src_ids), src_base=self.pool.data_ptr(),
                                      dst_base=remote_base, block_bytes=self.layout.block_bytes,
                                      src_device=self._device_id,
                                      dst_device=rec.staging.device_id)
            return await self._send(peer, local, remote, msg, "staged")
        local_off = self._alloc.alloc(nbytes)
        if local_off is None:
            raise StagingFull(f"local staging cannot hold {nbytes} B of FP8 payload")
        try:
            build_fp8(self.pool, src_ids, self.layout,
                      self._staging[local_off:local_off + nbytes])
            local = [(self._staging.data_ptr() + local_off, nbytes, self._device_id)]
            remote = [(remote_base, nbytes, rec.staging.device_id)]
            return await self._send(peer, local, remote, msg, "staged")
        finally:
            self._alloc.free(local_off)

    async def _request_staging(self, peer: str, request_id: str, nbytes: int) -> int:
        """Ask the receiver for a staging region; returns its offset."""
        self._port.send(peer, encode(StageRequest(request_id=request_id, nbytes=nbytes,
                                                 instance_id=self.instance_id)))
        deadline = time.monotonic() + self.config.grant_timeout_s
        while (grant := self._inbox.take_grant(request_id)) is None:
            if time.monotonic() > deadline:
                raise TransferTimeout(f"no staging grant from {peer!r} for {request_id} "
                                      f"within {self.config.grant_timeout_s}s")
            self._drain()
            await asyncio.sleep(self.config.notif_poll_s)
        if grant.offset is None:
            raise StagingFull(f"peer {peer!r} refused staging for {request_id}: {grant.error}")
        return grant.offset

    async def _send(self, peer, local, remote, notif: bytes, path: str) -> WriteResult:
        seconds = await post_and_wait(
            self._port, peer, local, remote, self._mem_type, notif,
            timeout_s=self.config.timeout_s, poll_spin_s=self.config.poll_spin_s,
            poll_initial_s=self.config.poll_initial_s, poll_max_s=self.config.poll_max_s)
        return WriteResult(path, sum(d[1] for d in local), len(local), seconds)

    # ------------------------------------------------------------------ receiving
    def _drain(self) -> bool:
        """Dispatch every pending NIXL notification; grants to answer are queued.
        Returns whether there was any."""
        seen = False
        for peer, raw in self._port.drain():
            seen = True
            msg = decode(raw)
            if isinstance(msg, KvArrived):
                self._inbox.on_arrived(peer, msg)
            elif isinstance(msg, StageRequest):
                grant = self._inbox.on_stage_request(peer, msg)
                self._replies.append((peer, msg.instance_id, grant))
            elif isinstance(msg, StageGrant):
                self._inbox.on_grant(msg)
            else:
                log.debug("ignoring a foreign notification from %s", peer)
        return seen

    async def _answer(self) -> None:
        """Send queued staging grants (may fetch the sender's record first)."""
        while self._replies:
            peer, instance_id, grant = self._replies.pop(0)
            try:
                self._peers.expect(peer, instance_id)
                await self._peers.get(peer)
                self._port.send(peer, encode(grant))
            except TransferError as exc:
                log.warning("cannot answer staging request of %s: %s", peer, exc)

    async def _poll_loop(self) -> None:
        """Drain every ``notif_poll_s`` while a transfer is expected (and ``notif_busy_s``
        after), else every ``notif_idle_poll_s`` until ``expect`` wakes it: an idle
        receiver no longer wakes its event loop a thousand times a second."""
        cfg = self.config
        while True:
            seen = self._drain()
            await self._answer()
            now = time.monotonic()
            if seen or self._inbox.expecting():
                self._busy_until = now + cfg.notif_busy_s
            if now < self._busy_until:
                await asyncio.sleep(cfg.notif_poll_s)
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), cfg.notif_idle_poll_s)

    def expect(self) -> None:
        """A transfer to this agent is coming (blocks were reserved for a remote
        prefill, or a request waits for its KV): poll every ``notif_poll_s`` from now."""
        self._busy_until = time.monotonic() + self.config.notif_busy_s
        if self._wake is not None:
            self._wake.set()

    def start_poller(self) -> None:
        """Decode side: drain notifications in the background (also answers staging
        requests). Started by ``wait_for``; stopped by ``close``."""
        if self._poller is None or self._poller.done():
            self._wake = asyncio.Event()
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    def poll_notifications(self) -> list[Arrival]:
        """Decode side, from an engine loop: arrivals not claimed by ``wait_for``.

        Staging requests seen here are answered by the poller, or by the next call
        made from a running event loop."""
        self._drain()
        if self._replies:
            with contextlib.suppress(RuntimeError):     # no running loop: poller answers
                asyncio.get_running_loop().create_task(self._answer())
        return self._inbox.take_ready()

    def cancel(self, request_id: str) -> None:
        """Decode side: nobody will wait for ``request_id`` any more; its arrival, past
        or late, is dropped (a late staged payload is not unpacked)."""
        self._inbox.cancel(request_id)

    async def wait_for(self, request_id: str, timeout_s: float | None = None) -> Arrival:
        """Decode side: wait until ``request_id``'s KV is in the pool; returns its Arrival.

        Raises TransferTimeout after ``timeout_s`` (default ``config.timeout_s``); the
        request is then cancelled so a late staged payload is discarded, and the caller
        prefills locally.
        """
        self.start_poller()
        self.expect()
        fut = self._inbox.waiter(request_id, asyncio.get_running_loop().create_future)
        try:
            return await asyncio.wait_for(fut, timeout_s or self.config.timeout_s)
        except TimeoutError:
            self._inbox.cancel(request_id)
            raise TransferTimeout(f"KV of {request_id} did not arrive within "
                                  f"{timeout_s or self.config.timeout_s}s") from None
