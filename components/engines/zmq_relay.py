"""The one ZMQ subscriber loop that relays an engine's KV-event batches (vLLM, SGLang).

Both engines' publishers *connect* to a specific-host endpoint, so the subscriber binds
and must be up before the engine starts: then no early event is missed and nothing
listens beyond loopback.  Each engine supplies only how its batch payload becomes this
project's KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from splitserve.contracts.kit.procs import free_port
from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent, Tier

LOOPBACK_PREFIX = "tcp://127.0.0.1:"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the relay binds it moments later)."""
    return free_port("127.0.0.1")


def block_hash(h: bytes | int) -> int:
    """An engine's block hash (bytes or int) as the signed 64-bit int Dynamo's events carry.

    Only identity matters: the router indexes tokens by its own hash and uses these to
    chain parents and to remove blocks, so any stable injective-enough map works.
    """
    if isinstance(h, int):
        return ((h + (1 << 63)) % (1 << 64)) - (1 << 63)
    return int.from_bytes(bytes(h)[:8].ljust(8, b"\0"), "little", signed=True)


# An engine event's ``medium`` (vLLM, SGLang) as this project's tier; the names are those
# Dynamo's router maps too.  A medium not listed (an external store) has no tier here.
MEDIUM_TIERS: dict[str | None, Tier] = {
    None: "device", "GPU": "device", "DEVICE": "device", "CPU": "host", "CPU_PINNED": "host",
    "CPU_TIER1": "host", "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk",
    "STORAGE": "disk"}


def tier_of(ev: Any) -> Tier | None:
    """The tier an engine event is about (None: a medium this project does not track)."""
    medium = getattr(ev, "medium", None)
    return MEDIUM_TIERS.get(medium.upper() if isinstance(medium, str) else medium)


def stored_event(ev: Any, block_size: int, tier: Tier = "device") -> BlockStored:
    """A ``BlockStored`` of vLLM's or SGLang's (same fields) as this project's event; the
    caller has checked that its tokens fill its blocks of ``block_size``."""
    parent = None if ev.parent_block_hash is None else block_hash(ev.parent_block_hash)
    return BlockStored(block_hashes=tuple(block_hash(h) for h in ev.block_hashes),
                       parent_hash=parent, token_ids=tuple(ev.token_ids),
                       num_block_tokens=(block_size,) * len(ev.block_hashes), tier=tier)


def removed_event(ev: Any, tier: Tier = "device") -> BlockRemoved:
    """A ``BlockRemoved`` of vLLM's or SGLang's as this project's event."""
    return BlockRemoved(tuple(block_hash(h) for h in ev.block_hashes), tier=tier)


class LowerTierLedger:
    """How often each lower-tier block has been announced and not yet removed.

    vLLM's offload tier stores KV in chunks of several blocks; a chunk that overlaps a
    shared prefix announces the shared blocks again, once per chunk, and removes them as
    often (its events module asks consumers to count).  The routers' tier index holds a
    block once per tier, so ``admit`` passes a lower-tier store on only for blocks the
    tier did not hold yet, and a removal only when a block's last announcement goes.
    Pool (``device``) events pass untouched.
    """

    def __init__(self) -> None:
        self.held: dict[tuple[Tier, int], int] = {}

    def admit(self, events: list[KvEvent]) -> list[KvEvent]:
        out: list[KvEvent] = []
        for ev in events:
            if ev.tier == "device":
                out.append(ev)
            elif isinstance(ev, BlockStored):
                out += self._stored(ev)
            else:
                gone = tuple(h for h in ev.block_hashes if self._drop(ev.tier, h))
                if gone:
                    out.append(BlockRemoved(gone, tier=ev.tier))
        return out

    def _stored(self, ev: BlockStored) -> list[BlockStored]:
        """The runs of ``ev``'s blocks new to its tier, each chained to the block
        before it."""
        runs: list[BlockStored] = []
        run: list[int] = []  # indexes of the current run of new blocks
        for i, h in enumerate(ev.block_hashes):
            key = (ev.tier, h)
            self.held[key] = self.held.get(key, 0) + 1
            if self.held[key] == 1:
                run.append(i)
            elif run:
                runs.append(self._run(ev, run))
                run = []
        if run:
            runs.append(self._run(ev, run))
        return runs

    @staticmethod
    def _run(ev: BlockStored, run: list[int]) -> BlockStored:
        first, last = run[0], run[-1]
        offset = sum(ev.num_block_tokens[:first])
        end = offset + sum(ev.num_block_tokens[first:last + 1])
        parent = ev.parent_hash if first == 0 else ev.block_hashes[first - 1]
        return dataclasses.replace(
            ev, block_hashes=ev.block_hashes[first:last + 1], parent_hash=parent,
            token_ids=ev.token_ids[offset:end],
            num_block_tokens=ev.num_block_tokens[first:last + 1])

    def _drop(self, tier: Tier, h: int) -> bool:
        """Count one removal of ``h`` from ``tier``; True when the tier no longer holds
        it (a removal of a block never announced is not passed on)."""
        n = self.held.get((tier, h))
        if n is None:
            return False
        if n <= 1:
            del self.held[(tier, h)]
            return True
        self.held[(tier, h)] = n - 1
        return False


async def relay_batches(endpoint: str, convert: Callable[[bytes], list[KvEvent]],
                        sink: Callable[[list[KvEvent]], None], log: logging.Logger,
                        ready: asyncio.Event | None = None) -> None:
    """Bind ``endpoint`` (``tcp://127.0.0.1:PORT``), feed converted batches to ``sink``
    until cancelled; ``ready`` is set once the socket is bound.  A batch that cannot be
    decoded is logged and skipped, never fatal."""
    import zmq
    import zmq.asyncio

    if not endpoint.startswith(LOOPBACK_PREFIX):
        raise ValueError(f"the KV event relay listens on loopback only, got {endpoint!r}")
    sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    if ready is not None:
        ready.set()
    try:
        while True:
            parts = await sub.recv_multipart()
            if len(parts) != 3:  # topic, sequence number, payload
                continue
            try:
                events = convert(parts[2])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable KV event batch: %s", exc)
                continue
            if events:
                sink(events)
    finally:
        with contextlib.suppress(Exception):
            sub.close(0)
