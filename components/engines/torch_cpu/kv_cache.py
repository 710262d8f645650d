"""Paged KV cache: one pool tensor, per-sequence block tables, prefix caching.

The pool is laid out ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` so that one block (every layer's K and V for ``block_size``
tokens) is one contiguous region: a KV-transfer layer can register the pool
once and move whole blocks between processes by block id.

Blocks whose reference count drops to zero keep their contents and their hash;
they are reused as cache hits until a fresh block is needed, at which point the
least recently released one is evicted (``BlockRemoved``).

KV computed with a LoRA adapter is not the base model's: a sequence's hashes are seeded
with its adapter's name (``hash_block``'s ``lora_name``), so a prefix is only reused by
requests of the same adapter, and its ``BlockStored`` events say which adapter it is.

With offload tiers (``kv_tiers.TierChain``), an evicted cached block is copied one tier
down instead of dropped, and a prefix lookup that misses in the pool goes on in the tiers,
block by block along the hash chain: blocks found there are copied into fresh pool blocks
and count as cached.  Events name their tier: a block leaving the pool is ``BlockRemoved``
from the device tier and ``BlockStored`` in the tier that took it; one a tier moves down or
drops is removed from it (and stored in the next); one copied back is ``BlockStored`` in
the device tier again, the tier keeping its copy.  Without tiers every event is the pool's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent, Tier, hash_block

from .kv_tiers import BlockOrigin

if TYPE_CHECKING:
    from .kv_tiers import TierChain, TierStats

POOL_DTYPE = torch.float32
RESTORE_SMOOTHING = 0.2
"""Weight of the newest block restore in a tier's smoothed restore cost."""


def block_nbytes(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one pool block: every layer's K and V for ``block_size`` tokens."""
    return (block_size * num_layers * 2 * num_kv_heads * head_dim
            * torch.empty((), dtype=POOL_DTYPE).element_size())


@dataclass
class _SeqBlocks:
    lora_name: str | None = None  # the adapter its KV is computed with
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of the leading full blocks


class KVCacheManager:
    """Owns the KV pool and decides which block holds which tokens.

    Pure bookkeeping plus one tensor: no model code. Sequence ids are the
    engine's request ids.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tiers: TierChain | None = None,
    ) -> None:
        """``tiers``: where evicted cached blocks go (None: they are dropped)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Zeros, not empty: attention reads (and masks) the unwritten tail of a
        # block, and 0 * garbage must stay 0 (NaN would not).
        self._pool = torch.zeros(
            num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=POOL_DTYPE
        )  # [blocks, layers, K/V, block_size, kv_heads, head_dim]
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._adapter: dict[int, str] = {}  # hashed block id -> its adapter (if any)
        # Blocks with ref 0, in eviction order (first = evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._seqs: dict[str, _SeqBlocks] = {}
        self._events: list[KvEvent] = []
        self._tiers = tiers
        # Hashed block id -> its parent's hash and tokens, for its BlockStored in a tier
        # and for announcing it again (``announced_events``).
        self._origin: dict[int, BlockOrigin] = {}
        self.num_offloaded_blocks = 0  # cached blocks handed to the tiers on eviction
        self.num_restored_blocks = 0  # blocks copied back from the tiers into the pool
        # Per tier, what copying one block back into the pool takes (reading it from
        # the tier and the copy), ms, smoothed (``RESTORE_SMOOTHING``): the routers'
        # admission prices a lower-tier prefix hit at it (``restore_costs``).
        self._restore_ms: dict[Tier, float] = {}
        self.block_nbytes = self._pool[0].numel() * self._pool.element_size()

    # ---- public views -------------------------------------------------------------
    def pool(self) -> torch.Tensor:
        """Return the pool tensor itself (not a copy), for attention and KV transfer."""
        return self._pool

    def block_table(self, seq_id: str) -> list[int]:
        """Return a copy of the block ids holding ``seq_id``'s tokens, in order."""
        return list(self._seqs[seq_id].blocks)

    def has_sequence(self, seq_id: str) -> bool:
        """True while ``seq_id`` holds blocks (between ``open_sequence`` and ``free``)."""
        return seq_id in self._seqs

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (fresh or evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a prefix hash (live or evictable)."""
        return len(self._cached)

    def tier_stats(self) -> dict[str, TierStats]:
        """Each offload tier's counters by tier name ({} without tiers)."""
        return self._tiers.stats() if self._tiers is not None else {}

    def restore_costs(self) -> dict[Tier, float]:
        """Per lower tier that has restored a block: the measured ms to copy one block
        back into the pool (smoothed; a copy of the dict)."""
        return dict(self._restore_ms)

    def tier_capacity_blocks(self) -> dict[Tier, int]:
        """How many blocks each offload tier can hold, by tier name ({} without tiers)."""
        if self._tiers is None:
            return {}
        return {t.name: t.capacity_bytes // self.block_nbytes for t in self._tiers.tiers}

    def held_blocks(self) -> dict[Tier, set[int]]:
        """The hashes of the cached blocks each tier holds now: ``device`` (the pool's,
        live or evictable) and each offload tier's by name; what the KV events so far
        describe."""
        held: dict[Tier, set[int]] = {"device": set(self._cached)}
        if self._tiers is not None:
            held.update(self._tiers.held())
        return held

    def close(self) -> None:
        """Release the offload tiers (the disk tier's writer and files); called when the
        engine stops."""
        if self._tiers is not None:
            self._tiers.close()

    def announced_events(self) -> list[KvEvent]:
        """A ``BlockStored`` for every cached block: the pool's (each after the block
        before it, where the pool holds that one), then each tier's.  What a router that
        started late, or lost a tier's events, needs to see this engine's cache; stores
        of blocks a router already holds change nothing there."""
        events: list[KvEvent] = []
        done: set[int] = set()
        for h in list(self._cached):
            chain: list[int] = []
            cur: int | None = h
            while cur is not None and cur in self._cached and cur not in done:
                done.add(cur)
                chain.append(cur)
                origin = self._origin.get(self._cached[cur])
                cur = origin.parent_hash if origin is not None else None
            for x in reversed(chain):
                block = self._cached[x]
                origin = self._origin.get(block)
                if origin is None:
                    continue
                events.append(BlockStored(
                    block_hashes=(x,), parent_hash=origin.parent_hash,
                    token_ids=origin.token_ids, num_block_tokens=(len(origin.token_ids),),
                    lora_name=self._adapter.get(block)))
        if self._tiers is not None:
            events += self._tiers.announced_events()
        return events

    def drain_events(self) -> list[KvEvent]:
        """Return the KV events since the last call, oldest first, and forget them."""
        self._pull_tier_events()  # a disk write may have failed since
        events, self._events = self._events, []
        return events

    # ---- sequence lifecycle ---------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: Sequence[int], lora_name: str | None = None
                             ) -> int:
        """How many leading tokens of ``token_ids`` are cached now for adapter
        ``lora_name`` (None: the base model), without taking blocks.

        Called by a decode worker's offload decider before it decides where to prefill;
        counts the same blocks ``open_sequence`` would reuse (those in a lower tier
        included, as long as the pool has room to copy them back).
        """
        bs = self.block_size
        parent: int | None = None
        n = 0
        for i in range((len(token_ids) - 1) // bs):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs], lora_name)
            if h not in self._cached and (self._tiers is None or not self._tiers.contains(h)):
                break
            parent, n = h, n + 1
        return n * bs

    def open_sequence(self, seq_id: str, token_ids: Sequence[int], reuse: bool = True,
                      lora_name: str | None = None) -> int:
        """Start tracking ``seq_id`` and reuse the longest cached prefix of ``token_ids``
        computed with adapter ``lora_name`` (None: the base model).

        Called when a request is admitted (or re-admitted after preemption).
        Returns the number of leading tokens whose KV is already in the cache (the
        pool, or a lower tier it is copied back from).
        At least one token is always left uncached so that the engine computes
        the logits of the last position.  ``reuse=False`` reuses nothing (a request
        that needs the logits of every prompt position).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already open")
        seq = _SeqBlocks(lora_name)
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs if reuse else 0
        restored: list[int] = []  # indexes of blocks copied back from a tier
        parent: int | None = None
        for i in range(max_blocks):
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs], lora_name)
            block = self._cached.get(h)
            if block is not None:
                self._take(block)
            else:
                block = self._restore(h, lora_name, parent, token_ids[i * bs : (i + 1) * bs])
                if block is None:
                    break
                restored.append(i)
            seq.blocks.append(block)
            seq.hashes.append(h)
            parent = h
        self._seqs[seq_id] = seq
        self._emit_restored(seq, token_ids, restored)
        return len(seq.blocks) * bs

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens.

        Called before a step writes KV for new tokens. Returns False, and
        allocates nothing, when not enough blocks are free (the scheduler then
        preempts or waits).
        """
        seq = self._seqs[seq_id]
        needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            seq.blocks.append(self._fresh_block())
        return True

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Hash and publish every block of ``seq_id`` that is now full of computed KV.

        Called after each step (and when remote KV has arrived). Emits
        ``BlockStored`` for runs of newly cached blocks. A block whose hash is
        already served by another block stays unhashed and is simply freed later.
        """
        seq = self._seqs[seq_id]
        bs = self.block_size
        run: list[int] = []
        run_parent: int | None = None
        while (len(seq.hashes) + 1) * bs <= num_computed:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = hash_block(parent, token_ids[i * bs : (i + 1) * bs], seq.lora_name)
            seq.hashes.append(h)
            block = seq.blocks[i]
            if self._hash[block] is None and h not in self._cached:
                self._publish(block, h, seq.lora_name, parent, token_ids[i * bs : (i + 1) * bs])
                if not run:
                    run_parent = parent
                run.append(i)
            elif run:
                self._emit_stored(seq, token_ids, run, run_parent)
                run = []
        if run:
            self._emit_stored(seq, token_ids, run, run_parent)

    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s references; called when a request finishes, aborts or is preempted.

        Blocks are released tail first so that, among one sequence's blocks,
        the later ones are evicted before the shared prefix.
        """
        seq = self._seqs.pop(seq_id)
        for block in reversed(seq.blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
                if self._hash[block] is None:
                    # Nothing reusable inside: hand it out before any cached block.
                    self._free.move_to_end(block, last=False)

    def forget_lora(self, lora_name: str) -> None:
        """Unpublish every cached block computed with adapter ``lora_name``.

        Called when the adapter is unloaded: a later adapter loaded under the same name
        must not be credited with this one's KV.  The blocks keep their place in the
        pool but are handed out before any cached block (``BlockRemoved`` for them).
        """
        if self._tiers is not None:
            self._tiers.discard_adapter(lora_name)
            self._pull_tier_events()
        gone = [b for b, name in self._adapter.items() if name == lora_name]
        if not gone:
            return
        hashes = []
        for block in gone:
            del self._adapter[block]
            self._origin.pop(block, None)
            h = self._hash[block]
            self._hash[block] = None
            del self._cached[h]
            hashes.append(h)
            if self._ref[block] == 0:
                self._free.move_to_end(block, last=False)
        self._events.append(BlockRemoved(block_hashes=tuple(hashes)))

    # ---- internals --------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _fresh_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash[block]
        if old is not None:
            self._hash[block] = None
            del self._cached[old]
            lora_name = self._adapter.pop(block, None)
            origin = self._origin.pop(block, None)
            self._events.append(BlockRemoved(block_hashes=(old,)))
            if self._tiers is not None:
                # Copied now: the block is about to be overwritten.
                self._tiers.put(old, self._pool[block], lora_name, origin)
                self.num_offloaded_blocks += 1
                self._pull_tier_events()
        self._ref[block] = 1
        return block

    def _publish(self, block: int, h: int, lora_name: str | None, parent: int | None,
                 tokens: Sequence[int]) -> None:
        """Make ``block`` (whose tokens follow the block of hash ``parent``) the pool's
        cached copy of hash ``h``."""
        self._hash[block] = h
        self._cached[h] = block
        if lora_name is not None:
            self._adapter[block] = lora_name
        self._origin[block] = BlockOrigin(parent, tuple(tokens))

    def _pull_tier_events(self) -> None:
        """Append the tiers' events since the last pull (after each tier operation)."""
        if self._tiers is not None:
            self._events.extend(self._tiers.drain_events())

    def _restore(self, h: int, lora_name: str | None, parent: int | None,
                 tokens: Sequence[int]) -> int | None:
        """Copy the block of hash ``h`` (``tokens`` after the block of hash ``parent``)
        from the first tier holding it into a fresh pool block (taken, ref 1, cached);
        None when no tier holds it or no block is free."""
        if self._tiers is None or not self._free:
            return None
        start = time.perf_counter()
        found = self._tiers.fetch(h)
        took = time.perf_counter() - start
        self._pull_tier_events()  # a disk block that could not be read is gone
        if found is None:
            return None
        tier, data = found
        # Taking the block may evict another into the tiers (its write-back is not this
        # restore's cost); ``data`` stays valid (a tier hands its blocks over, it never
        # writes into them).
        block = self._fresh_block()
        start = time.perf_counter()
        self._pool[block].copy_(data)
        took_ms = (took + time.perf_counter() - start) * 1000.0
        last = self._restore_ms.get(tier)
        self._restore_ms[tier] = took_ms if last is None else \
            RESTORE_SMOOTHING * took_ms + (1.0 - RESTORE_SMOOTHING) * last
        self._publish(block, h, lora_name, parent, tokens)
        self.num_restored_blocks += 1
        return block

    def _emit_restored(self, seq: _SeqBlocks, token_ids: Sequence[int],
                       restored: list[int]) -> None:
        """``BlockStored`` for each run of consecutive restored blocks of ``seq``."""
        runs: list[list[int]] = []
        for i in restored:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = seq.hashes[run[0] - 1] if run[0] else None
            self._emit_stored(seq, token_ids, run, parent)

    def _emit_stored(
        self, seq: _SeqBlocks, token_ids: Sequence[int], run: list[int], parent: int | None
    ) -> None:
        bs = self.block_size
        tokens: list[int] = []
        for i in run:
            tokens.extend(token_ids[i * bs : (i + 1) * bs])
        self._events.append(
            BlockStored(
                block_hashes=tuple(seq.hashes[i] for i in run),
                parent_hash=parent,
                token_ids=tuple(tokens),
                num_block_tokens=(bs,) * len(run),
                lora_name=seq.lora_name,
            )
        )
