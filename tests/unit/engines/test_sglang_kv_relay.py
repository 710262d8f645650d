"""SGLang's KV event batches and scheduler metrics in this project's types."""

from __future__ import annotations

import time

import msgspec
import pytest

from splitserve.contracts.block_events import BlockRemoved, BlockStored
from splitserve.components.engines.sglang.kv_relay import convert_batch
from splitserve.components.engines.sglang.metrics import LoadTracker
from tests.unit.engines.upstream import needs_sglang_module, sglang_source

pytestmark = pytest.mark.unit

_sglang_installed = needs_sglang_module("sglang.srt.disaggregation.kv_events")

PAGE = 4


def test_stored_removed_and_other_tiers():
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        KVEventBatch,
    )
    from sglang.srt.disaggregation.kv_events import (
        BlockRemoved as SRemoved,
    )
    from sglang.srt.disaggregation.kv_events import (
        BlockStored as SStored,
    )

    batch = KVEventBatch(ts=time.time(), events=[
        SStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)),
                block_size=PAGE, lora_id=None),
        SStored(block_hashes=[3], parent_block_hash=2, token_ids=[1, 2], block_size=PAGE,
                lora_id=None),                                     # partial: skipped
        SStored(block_hashes=[4], parent_block_hash=2, token_ids=list(range(4)),
                block_size=PAGE, lora_id=None, medium="CPU_PINNED"),  # HiCache's host tier
        SStored(block_hashes=[5], parent_block_hash=2, token_ids=list(range(4)),
                block_size=PAGE, lora_id=None, medium="EXTERNAL"),    # not this worker's
        SRemoved(block_hashes=[1]),
        SRemoved(block_hashes=[4], medium="CPU_PINNED"),
        AllBlocksCleared(),
    ])
    from splitserve.contracts.kit.worker_metrics import KV_EVENT_DROPS

    before = dict(KV_EVENT_DROPS)
    stored, host, removed, host_removed = convert_batch(msgspec.msgpack.encode(batch), PAGE)
    assert KV_EVENT_DROPS["external-tier"] == before.get("external-tier", 0) + 1
    assert KV_EVENT_DROPS["token-count-mismatch"] == before.get("token-count-mismatch", 0) + 1
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == (1, 2) and stored.num_block_tokens == (PAGE, PAGE)
    assert stored.tier == removed.tier == "device"
    assert (host.block_hashes, host.parent_hash, host.tier) == ((4,), 2, "host")
    assert removed.block_hashes == (1,)
    assert (host_removed.block_hashes, host_removed.tier) == ((4,), "host")


def test_load_from_kv_metrics_fields_of_the_installed_sglang():
    # KvMetrics' module imports SGLang's multimodal stack (torchvision), so its fields
    # are read from the installed source and a plain object carries them.
    import ast
    from types import SimpleNamespace

    src = sglang_source("srt/managers/scheduler_components/kv_events_publisher.py")
    cls = src.node(ast.ClassDef, "KvMetrics")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    read = {"request_active_slots", "num_requests_waiting", "kv_active_blocks",
            "kv_total_blocks"}
    assert read <= fields
    t = LoadTracker(page_size=16)
    assert t.sample(inflight=2).active == 2  # before any metrics
    t.update(SimpleNamespace(request_active_slots=5, kv_active_blocks=33,
                             kv_total_blocks=1600, num_requests_waiting=2))
    s = t.sample(inflight=0)
    assert (s.active, s.waiting, s.kv_used_blocks, s.kv_total_blocks) == (5, 2, 3, 100)
