"""vLLM's, SGLang's and TensorRT-LLM's own lower KV tiers, as their relays turn them into
this project's tiered events: what each engine announces in its own event shape, and
what reaches the routers' tier index."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from prometheus_client import generate_latest

from splitserve.components.engines.sglang.config import SglangEngineArgs
from splitserve.components.engines.trtllm.config import TrtllmEngineArgs
from splitserve.components.engines.trtllm.events import PoolLevels, convert_event
from splitserve.components.engines.vllm.config import VllmEngineArgs
from splitserve.components.engines.zmq_relay import LowerTierLedger
from splitserve.contracts.block_events import BlockRemoved, BlockStored
from splitserve.contracts.engine import EngineCapabilities, EngineInfo
from splitserve.contracts.kit.worker_metrics import KV_EVENT_DROPS, WorkerMetrics
from tests.installed import needs_vllm

pytestmark = pytest.mark.unit

BS = 4


def stored(hashes, parent, tier="host", first_token=0) -> BlockStored:
    n = len(hashes)
    return BlockStored(block_hashes=tuple(hashes), parent_hash=parent,
                       token_ids=tuple(range(first_token, first_token + n * BS)),
                       num_block_tokens=(BS,) * n, tier=tier)


# ---- the ledger: vLLM's re-announced offload blocks ---------------------------------


def test_the_ledger_passes_each_lower_tier_block_once_and_its_last_removal():
    ledger = LowerTierLedger()
    # A chunk of blocks 1-2, then an overlapping chunk 2-3: block 2 is announced twice.
    first = ledger.admit([stored([1, 2], None)])
    second = ledger.admit([stored([2, 3], 1, first_token=BS)])
    assert [e.block_hashes for e in first] == [(1, 2)]
    (run,) = second
    assert (run.block_hashes, run.parent_hash) == ((3,), 2)  # chained to the block before
    assert run.token_ids == tuple(range(2 * BS, 3 * BS))
    # Removals fan out to every announcement: block 2 leaves with its last one.
    assert ledger.admit([BlockRemoved((1, 2), tier="host")]) == [
        BlockRemoved((1,), tier="host")]
    assert ledger.admit([BlockRemoved((2, 3), tier="host")]) == [
        BlockRemoved((2, 3), tier="host")]
    assert ledger.admit([BlockRemoved((9,), tier="host")]) == []  # never announced
    assert ledger.held == {}


def test_the_ledger_splits_a_store_around_blocks_already_held():
    ledger = LowerTierLedger()
    ledger.admit([stored([2], 1, first_token=BS)])
    runs = ledger.admit([stored([1, 2, 3], None)])
    assert [(r.block_hashes, r.parent_hash, r.token_ids[0]) for r in runs] == [
        ((1,), None, 0), ((3,), 2, 2 * BS)]


def test_the_ledger_leaves_the_pools_events_alone():
    ledger = LowerTierLedger()
    dev = [stored([1], None, tier="device"), stored([1], None, tier="device"),
           BlockRemoved((1,))]
    assert ledger.admit(dev) == dev
    assert ledger.held == {}


# ---- vLLM -----------------------------------------------------------------------------


@needs_vllm
def test_vllm_offload_chunks_reach_the_index_once_and_bare_hashes_are_dropped(caplog):
    """Self-describing offload events as vLLM's offloading connector writes them (a chunk
    of two blocks with its tokens and parent; a placeholder with none) become host-tier
    events; the placeholder is counted, not warned about per event."""
    from vllm.distributed.kv_events import MEDIUM_CPU, KVEventBatch
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored

    from splitserve.components.engines.vllm import kv_relay

    def chunk(hashes, parent, start):
        return VStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=list(range(start, start + len(hashes) * BS)), block_size=BS,
                       lora_id=None, medium=MEDIUM_CPU, lora_name=None)
    placeholder = VStored(block_hashes=[77], parent_block_hash=None, token_ids=[],
                          block_size=0, lora_id=None, medium=MEDIUM_CPU, lora_name=None)
    batch = KVEventBatch(ts=time.time(), events=[
        chunk([11, 12], None, 0), chunk([12, 13], 11, BS), placeholder,
        VRemoved(block_hashes=[11, 12], medium=MEDIUM_CPU)])
    ledger = LowerTierLedger()
    before = KV_EVENT_DROPS["offload-without-tokens"]
    with caplog.at_level(logging.WARNING, logger="splitserve.vllm"):
        events = ledger.admit(kv_relay.convert_batch(msgspec.msgpack.encode(batch), BS))
    assert KV_EVENT_DROPS["offload-without-tokens"] == before + 1
    text = generate_latest(WorkerMetrics().registry).decode()
    assert (f'splitserve_worker_kv_events_dropped_total{{reason="offload-without-tokens"}} '
            f'{before + 1:.1f}') in text
    assert not [r for r in caplog.records if r.name == "splitserve.vllm"]
    assert [(type(e).__name__, e.block_hashes, e.tier) for e in events] == [
        ("BlockStored", (11, 12), "host"), ("BlockStored", (13,), "host"),
        ("BlockRemoved", (11,), "host")]  # 12 is still held by the second chunk


# ---- declarations ---------------------------------------------------------------------


def test_each_engine_declares_the_lower_tiers_it_announces():
    assert VllmEngineArgs(kv_offloading_gib=1).lower_tiers() == {"host": None}
    assert VllmEngineArgs(kv_offloading_gib=1, kv_events=False).lower_tiers() == {}
    assert VllmEngineArgs().lower_tiers() == {}
    assert SglangEngineArgs(enable_hierarchical_cache=True).lower_tiers() == {"host": None}
    assert SglangEngineArgs().lower_tiers() == {}
    assert TrtllmEngineArgs(host_cache_gib=2).lower_tiers() == {"host": None}
    assert TrtllmEngineArgs().lower_tiers() == {}


def test_engine_info_refuses_a_lower_tier_that_is_not_below_the_pool():
    caps = EngineCapabilities(local_prefill=True, pushes_kv=False,
                              handoff_before_prefill=False, prefix_lookup=False,
                              moves_kv=False, reports_failure=False)
    with pytest.raises(ValueError, match=r"lower_tiers \['device'\]"):
        EngineInfo("x", 16, caps, lower_tiers={"device": 10})
    assert EngineInfo("x", 16, caps, lower_tiers={"host": None}).lower_tiers == {"host": None}


# ---- TensorRT-LLM ---------------------------------------------------------------------


def trt_stored(hashes, parent, start=0, level=0) -> dict:
    """A ``stored`` event as TensorRT-LLM's ``KVCacheEventSerializer`` writes it."""
    return {"event_id": 1, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": start + i * BS + t,
                     "token_extra_id": 0} for t in range(BS)]}
        for i, h in enumerate(hashes)]}}


def trt_updated(h, old, new, priority=(35, 35)) -> dict:
    diff = None if old is None else {"type": "event_diff", "old_value": old, "new_value": new}
    return {"event_id": 2, "data": {"type": "updated", "block_hash": h, "cache_level": diff,
                                    "priority": {"type": "event_diff",
                                                 "old_value": priority[0],
                                                 "new_value": priority[1]}}}


def test_trtllm_moves_between_its_pools_become_tier_moves():
    pools = PoolLevels()
    partial: set[int] = set()

    def conv(ev):
        return convert_event(ev, BS, partial, pools)
    (first,) = conv(trt_stored([5, 6], None))
    assert (first.block_hashes, first.tier) == ((5, 6), "device")
    # Block 6 goes to the host pool: one updated event naming only its hash.
    gone, landed = conv(trt_updated(6, 0, 1))
    assert (gone, landed.tier) == (BlockRemoved((6,), tier="device"), "host")
    assert (landed.block_hashes, landed.parent_hash) == ((6,), 5)
    assert landed.token_ids == tuple(range(BS, 2 * BS))
    assert conv(trt_updated(6, None, None, priority=(35, 0))) == []  # priority only
    assert conv(trt_updated(99, 0, 1)) == []  # a block never announced
    # Removed while in the host pool: removed from the host tier; 5 from the device.
    removed = conv({"data": {"type": "removed", "block_hashes": [5, 6]}})
    assert sorted((e.tier, e.block_hashes) for e in removed) == [
        ("device", (5,)), ("host", (6,))]
    assert pools.blocks == {}


def test_trtllm_block_back_on_the_gpu_leaves_the_host_tier():
    pools = PoolLevels()
    convert_event(trt_stored([5], None), BS, None, pools)
    convert_event(trt_updated(5, 0, 1), BS, None, pools)
    gone, back = convert_event(trt_updated(5, 1, 0), BS, None, pools)
    assert (gone.tier, back.tier, back.block_hashes) == ("host", "device", (5,))


def test_trtllm_without_a_host_pool_ignores_moves():
    (ev,) = convert_event(trt_stored([5], None), BS)
    assert ev.tier == "device"
    assert convert_event(trt_updated(5, 0, 1), BS) == []
