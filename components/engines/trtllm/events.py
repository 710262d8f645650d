"""TensorRT-LLM KV events and iteration stats in this project's types.

``LLM.get_kv_cache_events_async`` yields dicts ``{"event_id", "data": {"type": ...}}``:
``stored`` carries ``parent_hash`` and ``blocks`` (``block_hash`` and ``tokens``, each
``{"token_id": ...}``); ``removed`` carries ``block_hashes``.  A stored block shorter
than the block size is partial: it is not announced, and the rest of that event is
dropped (Dynamo's publisher does the same; a later event stores the full block).  Its
hash is remembered so that its ``removed`` event, which TensorRT-LLM sends like any
other, is not passed on either: the index never had that block.  A
``stored`` event's ``lora_name``, read by Dynamo's publisher too, goes on the event.
``LLM.get_stats_async`` yields iteration stats with ``numActiveRequests``,
``numQueuedRequests`` and ``kvCacheStats`` (``usedNumBlocks``, ``maxNumBlocks``).
"""

from __future__ import annotations

from typing import Any

from splitserve.contracts.engine import LoadSample
from splitserve.contracts.block_events import BlockRemoved, BlockStored, KvEvent
from splitserve.components.engines.zmq_relay import block_hash


def convert_event(event: dict[str, Any], block_size: int,
                  partial: set[int] | None = None) -> list[KvEvent]:
    """One TensorRT-LLM KV event as zero or one project events.  ``partial``: the raw
    hashes of partial blocks seen so far (kept by the caller across events), whose
    removals are dropped."""
    partial = set() if partial is None else partial
    data = event.get("data") or {}
    kind = data.get("type")
    if kind == "stored":
        hashes: list[int] = []
        tokens: list[int] = []
        for block in data.get("blocks") or ():
            block_tokens = [int(t["token_id"]) for t in block.get("tokens") or ()]
            if block.get("block_hash") is None:
                break
            if len(block_tokens) != block_size:
                partial.add(int(block["block_hash"]))
                break
            hashes.append(block_hash(int(block["block_hash"])))
            tokens += block_tokens
        if not hashes:
            return []
        parent = data.get("parent_hash")
        return [BlockStored(block_hashes=tuple(hashes),
                            parent_hash=None if parent is None else block_hash(int(parent)),
                            token_ids=tuple(tokens), num_block_tokens=(block_size,) * len(hashes),
                            lora_name=data.get("lora_name"))]
    if kind == "removed":
        hashes = []
        for h in data.get("block_hashes") or ():
            if h is None:
                continue
            if int(h) in partial:  # never announced: nothing to remove
                partial.discard(int(h))
                continue
            hashes.append(block_hash(int(h)))
        return [BlockRemoved(tuple(hashes))] if hashes else []
    return []  # "created" (the pool's initial blocks) and "updated" do not change the index


def load_from_stats(stat: dict[str, Any]) -> LoadSample:
    """One iteration-stats dict as a LoadSample."""
    kv = stat.get("kvCacheStats") or {}
    return LoadSample(active=int(stat.get("numActiveRequests", 0)),
                      waiting=int(stat.get("numQueuedRequests", 0)),
                      kv_used_blocks=int(kv.get("usedNumBlocks", 0)),
                      kv_total_blocks=int(kv.get("maxNumBlocks", 0)))
