"""Receiving side of the notification channel: arrivals, staged rebuilds and waiters.

The agent drains NIXL notifications and hands each decoded message here.  ``Inbox``
keeps arrivals until someone takes them (``wait_for`` or ``poll_notifications``), rebuilds
staged payloads into the pool, and holds staging grants for senders.  It does no I/O:
NIXL stays in the agent, and what must be sent back is returned as data.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from .errors import TransferError
from .layout import PoolLayout, needed_src_ranks
from .messages import KvArrived, StageGrant, StageRequest
from .payload import read_staged, rebuild, unpack_into
from .staging import StagingAllocator

log = logging.getLogger(__name__)


class Arrival(NamedTuple):
    """A request's KV is in this agent's pool: who sent it and the caller's payload."""

    peer: str
    request_id: str
    payload: bytes


class Inbox:
    """Per-agent receive state; every method is called on the event loop's thread."""

    def __init__(self, pool: torch.Tensor, layout: PoolLayout, staging: torch.Tensor | None,
                 allocator: StagingAllocator | None) -> None:
        self._pool = pool
        self._layout = layout
        self._staging = staging
        self._alloc = allocator
        self._ready: dict[str, Arrival | TransferError] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._grants: dict[str, StageGrant] = {}
        self._granted: dict[tuple[str, str], int] = {}      # (peer, request) -> offset
        self._partial: dict[str, dict[int, torch.Tensor]] = {}
        self._cancelled: set[str] = set()

    # ------------------------------------------------------------------ receiver
    def on_stage_request(self, peer: str, msg: StageRequest) -> StageGrant:
        """Reserve staging for a sender; returns the grant to send back."""
        if self._alloc is None:
            return StageGrant(request_id=msg.request_id, error="receiver has no staging pool")
        if msg.request_id in self._cancelled:
            return StageGrant(request_id=msg.request_id, error="request cancelled")
        offset = self._alloc.alloc(msg.nbytes)
        if offset is None:
            return StageGrant(request_id=msg.request_id,
                              error=f"staging full: {msg.nbytes} B asked, largest free "
                              f"{self._alloc.largest_free} B")
        self._granted[(peer, msg.request_id)] = offset
        return StageGrant(request_id=msg.request_id, offset=offset)

    def on_arrived(self, peer: str, msg: KvArrived) -> None:
        """Data for ``msg.request_id`` is in place (direct) or in staging (staged)."""
        if msg.staged is None:
            self._complete(msg.request_id, Arrival(peer, msg.request_id, msg.payload))
            return
        info = msg.staged
        offset = self._granted.pop((peer, msg.request_id), None)
        if offset is None or offset != info.offset or self._staging is None:
            log.warning("staged arrival %s from %s without a matching grant; dropped",
                        msg.request_id, peer)
            return
        try:
            shard = read_staged(self._staging[offset:offset + info.nbytes], info)
        finally:
            self._alloc.free(offset)
        if msg.request_id in self._cancelled:
            return
        shards = self._partial.setdefault(msg.request_id, {})
        shards[info.src_layout.tp_rank] = shard
        if set(shards) < set(needed_src_ranks(info.src_layout, self._layout)):
            return      # wait for the other sender ranks' shards
        del self._partial[msg.request_id]
        try:
            payload = rebuild(shards, info.src_layout, self._layout, info.num_tokens)
            unpack_into(self._pool, payload.to(self._pool.dtype), info.dst_block_ids)
            result: Arrival | TransferError = Arrival(peer, msg.request_id, msg.payload)
        except (ValueError, IndexError, RuntimeError) as exc:
            result = TransferError(f"cannot rebuild staged KV of {msg.request_id}: {exc}")
        self._complete(msg.request_id, result)

    def _complete(self, request_id: str, result: Arrival | TransferError) -> None:
        if request_id in self._cancelled:
            self._cancelled.discard(request_id)
            log.info("late arrival of cancelled request %s ignored", request_id)
            return
        fut = self._waiters.pop(request_id, None)
        if fut is None or fut.done():
            self._ready[request_id] = result
        elif isinstance(result, TransferError):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def expecting(self) -> bool:
        """Some request waits for its KV, or a staged payload is partly here."""
        return bool(self._waiters or self._partial)

    def take_ready(self) -> list[Arrival]:
        """Arrivals nobody waits for, oldest first; failed rebuilds are logged and dropped."""
        out = []
        for rid, res in list(self._ready.items()):
            del self._ready[rid]
            if isinstance(res, TransferError):
                log.warning("%s", res)
            else:
                out.append(res)
        return out

    def waiter(self, request_id: str, make_future: Callable[[], asyncio.Future]) -> asyncio.Future:
        """A future resolved by the arrival of ``request_id`` (at once if it is here)."""
        fut = make_future()
        res = self._ready.pop(request_id, None)
        if isinstance(res, TransferError):
            fut.set_exception(res)
        elif res is not None:
            fut.set_result(res)
        else:
            self._waiters[request_id] = fut
        return fut

    def cancel(self, request_id: str) -> None:
        """The caller gave up (timeout -> local prefill): a late staged arrival is not
        unpacked; a late direct write cannot be stopped, only ignored."""
        fut = self._waiters.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        self._partial.pop(request_id, None)
        if self._ready.pop(request_id, None) is None:
            self._cancelled.add(request_id)

    # ------------------------------------------------------------------ sender
    def on_grant(self, msg: StageGrant) -> None:
        self._grants[msg.request_id] = msg

    def take_grant(self, request_id: str) -> StageGrant | None:
        return self._grants.pop(request_id, None)
