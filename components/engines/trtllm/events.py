"""TensorRT-LLM KV events and iteration stats in this project's types.

``LLM.get_kv_cache_events_async`` yields dicts ``{"event_id", "data": {"type": ...}}``:
``stored`` carries ``parent_hash`` and ``blocks`` (``block_hash`` and ``tokens``, each
``{"token_id": ...}``); ``removed`` carries ``block_hashes``.  A stored block shorter
than the block size is partial: it is not announced, and the rest of that event is
dropped (Dynamo's publisher does the same; a later event stores the full block).  Its
hash is remembered so that its ``removed`` event, which TensorRT-LLM sends like any
other, is not passed on either: the index never had that block.  A
``stored`` event's ``lora_name``, read by Dynamo's publisher too, goes on the event.
With a host pool (``host_cache_gib``) TensorRT-LLM moves a block between its pools
without storing or removing it: one ``updated`` event names the block's hash and its
``cache_level`` change (0, the GPU pool; 1, the host pool), and a later ``removed``
names only the hash.  ``PoolLevels`` remembers each announced block's parent, tokens and
pool, so a move becomes a removal from one tier and a store in the other, and a removal
names the tier the block is in.
``LLM.get_stats_async`` yields iteration stats with ``numActiveRequests``,
``numQueuedRequests`` and ``kvCacheStats`` (``usedNumBlocks``, ``maxNumBlocks``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from splitserve.contracts.engine import LoadSample
from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent, Tier
from splitserve.components.engines.zmq_relay import block_hash


LEVEL_TIERS: dict[int, Tier] = {0: "device", 1: "host"}
"""TensorRT-LLM's cache levels as this project's tiers (primary: the GPU pool;
secondary: the host pool)."""


@dataclass
class _Block:
    parent: int | None  # TensorRT-LLM's hash of the block before it
    tokens: array
    level: int
    lora_name: str | None


class PoolLevels:
    """Each announced block's parent, tokens and cache level, for an engine with a host
    pool (kept by the relay across events; a block leaves when it is removed)."""

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}

    def tier(self, raw_hash: int) -> Tier:
        block = self.blocks.get(raw_hash)
        return LEVEL_TIERS.get(block.level, "device") if block else "device"


def convert_event(event: dict[str, Any], block_size: int,
                  partial: set[int] | None = None,
                  pools: PoolLevels | None = None) -> list[KvEvent]:
    """One TensorRT-LLM KV event as project events.  ``partial``: the raw hashes of
    partial blocks seen so far (kept by the caller across events), whose removals are
    dropped.  ``pools``: with a host pool, where each block is (moves and removals are
    then tiered); None: every block is the GPU pool's and moves are ignored."""
    partial = set() if partial is None else partial
    data = event.get("data") or {}
    kind = data.get("type")
    if kind == "stored":
        return _stored(data, block_size, partial, pools)
    if kind == "removed":
        by_tier: dict[Tier, list[int]] = {}
        for h in data.get("block_hashes") or ():
            if h is None:
                continue
            if int(h) in partial:  # never announced: nothing to remove
                partial.discard(int(h))
                continue
            tier = "device"
            if pools is not None:
                tier = pools.tier(int(h))
                pools.blocks.pop(int(h), None)
            by_tier.setdefault(tier, []).append(block_hash(int(h)))
        return [BlockRemoved(tuple(hs), tier=tier) for tier, hs in by_tier.items()]
    if kind == "updated" and pools is not None:
        return _moved(data, block_size, pools)
    return []  # "created" (the pool's initial blocks); "updated" without a host pool


def _stored(data: dict[str, Any], block_size: int, partial: set[int],
            pools: PoolLevels | None) -> list[KvEvent]:
    hashes: list[int] = []
    tokens: list[int] = []
    parent = data.get("parent_hash")
    parent = None if parent is None else int(parent)
    level = 0
    previous = parent
    for block in data.get("blocks") or ():
        block_tokens = [int(t["token_id"]) for t in block.get("tokens") or ()]
        if block.get("block_hash") is None:
            break
        if len(block_tokens) != block_size:
            partial.add(int(block["block_hash"]))
            break
        raw = int(block["block_hash"])
        if not hashes:
            level = int(block.get("cache_level") or 0)
        if pools is not None:
            pools.blocks[raw] = _Block(previous, array("q", block_tokens), level,
                                       data.get("lora_name"))
        previous = raw
        hashes.append(block_hash(raw))
        tokens += block_tokens
    if not hashes:
        return []
    tier = LEVEL_TIERS.get(level, "device") if pools is not None else "device"
    return [BlockStored(block_hashes=tuple(hashes),
                        parent_hash=None if parent is None else block_hash(parent),
                        token_ids=tuple(tokens), num_block_tokens=(block_size,) * len(hashes),
                        lora_name=data.get("lora_name"), tier=tier)]


def _moved(data: dict[str, Any], block_size: int, pools: PoolLevels) -> list[KvEvent]:
    """An ``updated`` event whose cache level changed: a removal from the old tier and a
    store in the new one (a priority change, or a block never announced: nothing)."""
    diff = data.get("cache_level") or {}
    raw = data.get("block_hash")
    block = pools.blocks.get(int(raw)) if raw is not None else None
    old, new = diff.get("old_value"), diff.get("new_value")
    if block is None or old is None or new is None or int(old) == int(new):
        return []
    if int(new) not in LEVEL_TIERS or int(old) not in LEVEL_TIERS:
        return []
    block.level = int(new)
    h = block_hash(int(raw))
    return [BlockRemoved((h,), tier=LEVEL_TIERS[int(old)]),
            BlockStored(block_hashes=(h,),
                        parent_hash=None if block.parent is None else block_hash(block.parent),
                        token_ids=tuple(block.tokens), num_block_tokens=(block_size,),
                        lora_name=block.lora_name, tier=LEVEL_TIERS[int(new)])]


def load_from_stats(stat: dict[str, Any]) -> LoadSample:
    """One iteration-stats dict as a LoadSample."""
    kv = stat.get("kvCacheStats") or {}
    return LoadSample(active=int(stat.get("numActiveRequests", 0)),
                      waiting=int(stat.get("numQueuedRequests", 0)),
                      kv_used_blocks=int(kv.get("usedNumBlocks", 0)),
                      kv_total_blocks=int(kv.get("maxNumBlocks", 0)))
