"""KV offload tiers below the paged pool: host memory, then disk.

A block evicted from the pool (``KVCacheManager``) keeps its contents one level down
instead of being dropped, keyed by its chained hash, so a later request whose prefix
misses in the pool can copy it back rather than recompute it.  Equal hashes mean equal
KV (``hash_block``), so a tier never needs the tokens.

Each tier is an LRU store with a byte budget and plain counters (``TierStats``) that an
adapter can export as metrics.  ``TierChain`` stacks them: what the host tier evicts is
written to the disk tier, and what the disk tier evicts is gone.

Each tier also logs which blocks it gained and lost (``TierChange``), and the chain turns
the logs into KV events of that tier, so the router knows where a block went.  A block
put with its place in its sequence (``BlockOrigin``: the parent's hash and its tokens)
can be announced as stored; tokens are kept for that alone.

Threads: every method is called from the engine's own thread, except that ``DiskTier``
writes its files on a small writer thread of its own (behind a bounded queue), so a
step does not wait for the disk; until its file is complete a block is served from the
copy waiting in the queue.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent, Tier

from .config import EngineConfig

GIB = 1 << 30


@dataclass
class TierStats:
    """Cumulative counters of one tier (``bytes_used`` is the current size)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0  # blocks stored (for the disk tier: files completed)
    evictions: int = 0  # blocks pushed out to make room
    errors: int = 0  # disk writes or reads that failed; the block is dropped
    bytes_used: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # copying into host memory, or writing files
    read_seconds: float = 0.0  # reading files (a host hit hands out its copy: ~0)
    # Per-operation latencies, counted per ``LATENCY_BUCKETS_S`` bound (cumulative, as a
    # Prometheus histogram's buckets are; the last one is +Inf): a worker's /metrics
    # exports them as histograms.
    write_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def observe_write(self, seconds: float) -> None:
        """One block written (copied into memory, or its file written)."""
        self.write_seconds += seconds
        _count(self.write_buckets, seconds)

    def observe_read(self, seconds: float) -> None:
        """One block read back (a host hit, or a file read)."""
        self.read_seconds += seconds
        _count(self.read_buckets, seconds)


LATENCY_BUCKETS_S: tuple[float, ...] = (
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds of the tiers' latency buckets, seconds (a block is 10 KiB to a few MiB)."""


def _count(buckets: list[int], seconds: float) -> None:
    for i, bound in enumerate(LATENCY_BUCKETS_S):
        if seconds <= bound:
            buckets[i] += 1
    buckets[-1] += 1


class BlockOrigin(NamedTuple):
    """Where a block sits in its sequence: what a ``BlockStored`` of it needs."""

    parent_hash: int | None  # the hash of the block before it (None: the first block)
    token_ids: tuple[int, ...]  # its own tokens


class TierBlock(NamedTuple):
    """One block's contents as a tier holds it."""

    key: int  # the block's chained hash
    data: torch.Tensor  # [layers, 2, block_size, kv_heads, head_dim], never written to
    lora_name: str | None  # the adapter its KV was computed with (None: the base model)
    origin: BlockOrigin | None = None  # None: the block is kept but never announced


class TierChange(NamedTuple):
    """A block a tier gained (``stored``) or lost, in its log."""

    stored: bool
    key: int
    lora_name: str | None = None  # stored blocks only, as their origin
    origin: BlockOrigin | None = None


class KvTier(Protocol):
    """A store of blocks by hash with a byte budget, least recently used out first."""

    name: Tier
    stats: TierStats

    def put(self, key: int, data: torch.Tensor, lora_name: str | None, *,
            copy: bool = True, origin: BlockOrigin | None = None) -> list[TierBlock]:
        """Store ``data`` under ``key`` (a copy of it, or ``data`` itself when ``copy`` is
        False and the caller hands it over); a key already held is only refreshed.
        Returns the blocks evicted to make room, for the next tier down."""
        ...

    def get(self, key: int) -> torch.Tensor | None:
        """The contents stored under ``key`` (read-only), or None; counts a hit or miss."""
        ...

    def contains(self, key: int) -> bool:
        """True when ``key`` is held; changes no counter and no LRU order."""
        ...

    def keys(self) -> list[int]:
        """Every key held now, least recently used first."""
        ...

    def announced(self) -> list[TierChange]:
        """A store for every block the tier holds that was announced (its origin
        known), least recently used first: what a router that starts late needs."""
        ...

    def drain_changes(self) -> list[TierChange]:
        """The blocks gained and lost since the last call, oldest first."""
        ...

    def discard_adapter(self, lora_name: str) -> None:
        """Forget every block computed with adapter ``lora_name`` (it was unloaded)."""
        ...

    def close(self) -> None:
        """Release what the tier holds (files included)."""
        ...


def _nbytes(data: torch.Tensor) -> int:
    return data.numel() * data.element_size()


class HostTier:
    """Blocks kept as tensors in host memory."""

    name: Tier = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._blocks: OrderedDict[int, TierBlock] = OrderedDict()
        self._changes: list[TierChange] = []

    def put(self, key: int, data: torch.Tensor, lora_name: str | None, *,
            copy: bool = True, origin: BlockOrigin | None = None) -> list[TierBlock]:
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        nbytes = _nbytes(data)
        start = time.perf_counter()
        owned = data.clone() if copy else data
        if nbytes > self.capacity_bytes:  # never fits here: straight to the next tier
            return [TierBlock(key, owned, lora_name, origin)]
        evicted = []
        while self.stats.bytes_used + nbytes > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self.stats.bytes_used -= _nbytes(old.data)
            self.stats.evictions += 1
            self._changes.append(TierChange(False, old.key))
            evicted.append(old)
        self._blocks[key] = TierBlock(key, owned, lora_name, origin)
        self._changes.append(TierChange(True, key, lora_name, origin))
        self.stats.observe_write(time.perf_counter() - start)
        self.stats.writes += 1
        self.stats.bytes_used += nbytes
        self.stats.bytes_written += nbytes
        return evicted

    def get(self, key: int) -> torch.Tensor | None:
        start = time.perf_counter()
        block = self._blocks.get(key)
        if block is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.stats.observe_read(time.perf_counter() - start)
        self.stats.hits += 1
        self.stats.bytes_read += _nbytes(block.data)
        return block.data

    def contains(self, key: int) -> bool:
        return key in self._blocks

    def keys(self) -> list[int]:
        return list(self._blocks)

    def announced(self) -> list[TierChange]:
        return [TierChange(True, b.key, b.lora_name, b.origin)
                for b in self._blocks.values() if b.origin is not None]

    def drain_changes(self) -> list[TierChange]:
        changes, self._changes = self._changes, []
        return changes

    def discard_adapter(self, lora_name: str) -> None:
        for key in [k for k, b in self._blocks.items() if b.lora_name == lora_name]:
            self.stats.bytes_used -= _nbytes(self._blocks.pop(key).data)
            self._changes.append(TierChange(False, key))

    def close(self) -> None:
        self._blocks.clear()
        self.stats.bytes_used = 0


@dataclass
class _DiskEntry:
    path: str
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    lora_name: str | None
    pending: torch.Tensor | None  # the copy to write; None once the file is complete
    origin: BlockOrigin | None = None  # for announcing it again (``announced``)


def _as_bytes(data: torch.Tensor):
    """A writable byte view (numpy) of a contiguous tensor's memory, for file I/O."""
    return data.reshape(-1).view(torch.uint8).numpy()


class DiskTier:
    """One file per block, of the tensor's raw bytes, in a folder of this tier's own.

    Files are written under a temporary name and renamed when complete, so a file with
    a block's name always holds the whole block.  The folder (inside ``directory``, which
    several engines may share) is removed on ``close`` or when the tier is collected.
    """

    name: Tier = "disk"

    def __init__(self, directory: str, capacity_bytes: int, queue_depth: int = 64) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="kv-", dir=directory)
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # guards _index, _changes and stats against the writer
        self._index: OrderedDict[int, _DiskEntry] = OrderedDict()
        self._changes: list[TierChange] = []  # a failed write is logged by the writer
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_depth)
        writer = threading.Thread(target=_write_loop, name="kv-disk-writer", daemon=True,
                                  args=(self._jobs, self._lock, self._index, self.stats,
                                        self._changes))
        # Not a method of self: the writer must not keep the tier alive.
        self._close = weakref.finalize(self, _shut_down, self._jobs, writer, self._lock,
                                       self._index, self.directory)
        writer.start()

    def put(self, key: int, data: torch.Tensor, lora_name: str | None, *,
            copy: bool = True, origin: BlockOrigin | None = None) -> list[TierBlock]:
        nbytes = _nbytes(data)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
            if nbytes > self.capacity_bytes:
                return []
            while self.stats.bytes_used + nbytes > self.capacity_bytes:
                self._evict_lru()
        start = time.perf_counter()
        owned = data.clone() if copy else data.contiguous()
        entry = _DiskEntry(os.path.join(self.directory, f"{key & (2**64 - 1):016x}.kv"),
                           nbytes, owned.shape, owned.dtype, lora_name, owned, origin)
        with self._lock:
            self.stats.write_seconds += time.perf_counter() - start  # the copy; the file's
            self.stats.bytes_used += nbytes  # write is observed by the writer
            self._index[key] = entry
            self._changes.append(TierChange(True, key, lora_name, origin))
        self._jobs.put((key, entry))  # outside the lock: a full queue waits for the writer
        return []

    def get(self, key: int) -> torch.Tensor | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
            pending = entry.pending
        if pending is not None:
            with self._lock:
                self.stats.hits += 1
                self.stats.observe_read(0.0)
            return pending
        # Only this thread removes files, so the file stays while it is read.
        start = time.perf_counter()
        out = torch.empty(entry.shape, dtype=entry.dtype)
        try:
            with open(entry.path, "rb") as f:
                n = f.readinto(_as_bytes(out))
        except OSError:
            n = -1
        with self._lock:
            if n != entry.nbytes:
                self.stats.errors += 1
                self.stats.misses += 1
                if self._index.get(key) is entry:
                    self._drop(key)
                return None
            self.stats.hits += 1
            self.stats.bytes_read += n
            self.stats.observe_read(time.perf_counter() - start)
        return out

    def contains(self, key: int) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def announced(self) -> list[TierChange]:
        with self._lock:
            return [TierChange(True, k, e.lora_name, e.origin)
                    for k, e in self._index.items() if e.origin is not None]

    def drain_changes(self) -> list[TierChange]:
        with self._lock:
            changes = list(self._changes)
            self._changes.clear()  # the writer holds the same list
        return changes

    def discard_adapter(self, lora_name: str) -> None:
        with self._lock:
            for key in [k for k, e in self._index.items() if e.lora_name == lora_name]:
                self._drop(key)

    def flush(self) -> None:
        """Wait until every queued block has been written (or skipped)."""
        self._jobs.join()

    def close(self) -> None:
        self._close()

    def _evict_lru(self) -> None:
        self._drop(next(iter(self._index)))
        self.stats.evictions += 1

    def _drop(self, key: int) -> None:
        """Forget ``key``; lock held.  A block still queued is skipped by the writer."""
        entry = self._index.pop(key)
        self.stats.bytes_used -= entry.nbytes
        self._changes.append(TierChange(False, key))
        if entry.pending is None:
            _remove(entry.path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write_loop(jobs: queue.Queue, lock: threading.Lock,
                index: OrderedDict[int, _DiskEntry], stats: TierStats,
                changes: list[TierChange]) -> None:
    """The disk tier's writer thread: one queued block at a time, until None."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            _write_one(*job, lock, index, stats, changes)
        finally:
            jobs.task_done()


def _write_one(key: int, entry: _DiskEntry, lock: threading.Lock,
               index: OrderedDict[int, _DiskEntry], stats: TierStats,
               changes: list[TierChange]) -> None:
    with lock:
        if index.get(key) is not entry:
            return  # evicted (or discarded) before its turn
        data = entry.pending
    tmp = entry.path + ".tmp"
    start = time.perf_counter()
    try:
        with open(tmp, "wb") as f:
            f.write(_as_bytes(data))
    except OSError:  # disk full, folder gone: the block is simply not kept
        _remove(tmp)
        with lock:
            stats.errors += 1
            if index.get(key) is entry:
                del index[key]
                stats.bytes_used -= entry.nbytes
                changes.append(TierChange(False, key))
        return
    elapsed = time.perf_counter() - start
    with lock:
        if index.get(key) is entry:
            # Under the lock: an eviction sees either the pending copy or the whole file.
            os.replace(tmp, entry.path)
            entry.pending = None
            # Observed with the write it times, so the histogram's count is the writes
            # (a block evicted while its file was written is neither).
            stats.observe_write(elapsed)
            stats.writes += 1
            stats.bytes_written += entry.nbytes
            return
    _remove(tmp)  # evicted while it was being written


def _shut_down(jobs: queue.Queue, writer: threading.Thread, lock: threading.Lock,
               index: OrderedDict[int, _DiskEntry], directory: str) -> None:
    with lock:
        index.clear()  # queued blocks are skipped, not written
    if writer is threading.current_thread():  # collected by the writer itself: no waiting
        with contextlib.suppress(queue.Full):
            jobs.put_nowait(None)
    else:
        jobs.put(None)
        writer.join()
    shutil.rmtree(directory, ignore_errors=True)


def _events(tier: Tier, changes: list[TierChange]) -> list[KvEvent]:
    """One tier's changes as KV events, in order (consecutive removals in one event; a
    block stored without an origin is kept but never announced)."""
    events: list[KvEvent] = []
    for change in changes:
        if not change.stored:
            last = events[-1] if events else None
            if isinstance(last, BlockRemoved):
                events[-1] = BlockRemoved(last.block_hashes + (change.key,), tier=tier)
            else:
                events.append(BlockRemoved((change.key,), tier=tier))
        elif change.origin is not None:
            tokens = change.origin.token_ids
            events.append(BlockStored(
                block_hashes=(change.key,), parent_hash=change.origin.parent_hash,
                token_ids=tokens, num_block_tokens=(len(tokens),),
                lora_name=change.lora_name, tier=tier))
    return events


class TierChain:
    """Tiers from the fastest down: evictions of one are written to the next."""

    def __init__(self, tiers: Sequence[KvTier]) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = list(tiers)

    def put(self, key: int, data: torch.Tensor, lora_name: str | None,
            origin: BlockOrigin | None = None) -> None:
        """Keep a copy of ``data`` (a pool block about to be reused) in the first tier;
        called when the pool evicts a cached block."""
        spill = self.tiers[0].put(key, data, lora_name, origin=origin)
        for tier in self.tiers[1:]:
            spill = [out for b in spill
                     for out in tier.put(b.key, b.data, b.lora_name, copy=False,
                                         origin=b.origin)]

    def get(self, key: int) -> torch.Tensor | None:
        """The block stored under ``key`` in the first tier that holds it (read-only)."""
        found = self.fetch(key)
        return None if found is None else found[1]

    def fetch(self, key: int) -> tuple[Tier, torch.Tensor] | None:
        """``get``, with the name of the tier that held the block."""
        for tier in self.tiers:
            data = tier.get(key)
            if data is not None:
                return tier.name, data
        return None

    def contains(self, key: int) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def held(self) -> dict[Tier, set[int]]:
        """The keys each tier holds now, by tier name."""
        return {t.name: set(t.keys()) for t in self.tiers}

    def announced_events(self) -> list[KvEvent]:
        """A ``BlockStored`` for every announced block each tier holds now (a router
        that starts late learns the tiers from them; stores are idempotent for the
        routers that already knew)."""
        return [ev for tier in self.tiers for ev in _events(tier.name, tier.announced())]

    def drain_events(self) -> list[KvEvent]:
        """KV events of the blocks each tier gained and lost since the last call, each
        tier's in order; called after every chain operation and when the pool's events
        are drained (a disk write that fails is logged by the writer thread)."""
        return [ev for tier in self.tiers for ev in _events(tier.name, tier.drain_changes())]

    def discard_adapter(self, lora_name: str) -> None:
        for tier in self.tiers:
            tier.discard_adapter(lora_name)

    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters by tier name (live objects: read, do not change)."""
        return {t.name: t.stats for t in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def _available_memory() -> int:
    """Bytes of memory the machine can still hand out without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_tiers(config: EngineConfig, block_nbytes: int) -> TierChain | None:
    """The tiers ``config`` asks for, or None when both are off; called once where the
    pool is built.  ValueError naming the field when the machine has not the room
    (memory available now, free space in the directory) or a tier holds no block."""
    tiers: list[KvTier] = []
    if config.host_kv_cache_gib > 0:
        size = int(config.host_kv_cache_gib * GIB)
        _check_size("host_kv_cache_gib", config.host_kv_cache_gib, size, block_nbytes,
                    _available_memory(), "of memory is available")
        tiers.append(HostTier(size))
    if config.disk_kv_cache_gib > 0:
        directory = config.disk_kv_cache_dir
        size = int(config.disk_kv_cache_gib * GIB)
        os.makedirs(directory, exist_ok=True)
        _check_size("disk_kv_cache_gib", config.disk_kv_cache_gib, size, block_nbytes,
                    shutil.disk_usage(directory).free, f"is free in {directory}")
        tiers.append(DiskTier(directory, size))
    return TierChain(tiers) if tiers else None


def _check_size(field: str, gib: float, size: int, block_nbytes: int, room: int,
                where: str) -> None:
    if size > room:
        raise ValueError(f"engine_args.{field}={gib}: only {room / GIB:.2f} GiB {where}")
    if size < block_nbytes:
        raise ValueError(f"engine_args.{field}={gib}: holds no KV block "
                         f"(one block is {block_nbytes} bytes)")
