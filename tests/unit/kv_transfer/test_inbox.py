"""The receive logic without NIXL: staging grants, staged rebuilds, waiters, cancel.

A sender's write is simulated by copying its payload bytes into the receiver's staging
buffer at the granted offset, exactly what the NIXL WRITE does.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from splitserve.components.engines.torch_cpu.kv_transfer import Arrival, TransferError
from splitserve.components.engines.torch_cpu.kv_transfer.inbox import Inbox
from splitserve.components.engines.torch_cpu.kv_transfer.messages import KvArrived, StagedInfo, StageRequest
from splitserve.components.engines.torch_cpu.kv_transfer.payload import build_fp8, staged_nbytes
from splitserve.components.engines.torch_cpu.kv_transfer.staging import StagingAllocator
from splitserve.kernels.kv_fp8 import compress, error_bound
from splitserve.kernels.kv_pack import kv_pack

from .factories import layout, pool_for, tokens_of

pytestmark = pytest.mark.unit

STAGING = 1 << 20


def _receiver(lay, num_blocks=12, seed=5):
    pool = pool_for(lay, num_blocks, seed)
    staging = torch.zeros(STAGING, dtype=torch.uint8)
    alloc = StagingAllocator(STAGING, 4096)
    return pool, Inbox(pool, lay, staging, alloc), staging, alloc


def _stage(inbox, staging, src_pool, src_lay, src_ids, dst_ids, num_tokens, *, fp8=False,
           rid="r1", peer="prefill-0"):
    """Simulate one sender rank: ask for staging, write the payload, send the arrival."""
    nbytes = staged_nbytes(src_lay, len(src_ids), fp8)
    grant = inbox.on_stage_request(peer, StageRequest(request_id=rid, nbytes=nbytes,
                                                      instance_id="i"))
    assert grant.error is None
    region = staging[grant.offset:grant.offset + nbytes]
    if fp8:
        assert build_fp8(src_pool, src_ids, src_lay, region) == nbytes
    else:
        region.copy_(kv_pack(src_pool, src_ids).view(-1).view(torch.uint8))
    info = StagedInfo(offset=grant.offset, nbytes=nbytes, src_layout=src_lay,
                      num_src_blocks=len(src_ids), num_tokens=num_tokens,
                      dst_block_ids=dst_ids, fp8=fp8)
    inbox.on_arrived(peer, KvArrived(request_id=rid, payload=b"tok", staged=info))


def test_direct_arrival_reaches_waiter_or_poll():
    async def main():
        _, inbox, _, _ = _receiver(layout())
        fut = inbox.waiter("a", asyncio.get_running_loop().create_future)
        inbox.on_arrived("p", KvArrived(request_id="a", payload=b"x"))
        assert await fut == Arrival("p", "a", b"x")
        inbox.on_arrived("p", KvArrived(request_id="b", payload=b"y"))
        assert inbox.take_ready() == [Arrival("p", "b", b"y")]
        assert inbox.take_ready() == []
    asyncio.run(main())


def test_staged_reshard_and_rechunk():
    src_lay = layout(block_size=4, heads=3)
    dst_lay = layout(block_size=8, heads=1, tp_size=3, tp_rank=2, total=3)
    src_pool = pool_for(src_lay, 10, seed=1)
    pool, inbox, staging, alloc = _receiver(dst_lay)
    before = pool.clone()
    _stage(inbox, staging, src_pool, src_lay, [3, 4, 5, 9], [10, 2], num_tokens=13)
    assert inbox.take_ready() == [Arrival("prefill-0", "r1", b"tok")]
    got = tokens_of(pool, [10, 2], 16)
    want = tokens_of(src_pool, [3, 4, 5, 9], 13)[..., 2:3, :]
    assert torch.equal(got[:, :, :13], want)
    assert torch.count_nonzero(got[:, :, 13:]) == 0        # padding past the last token
    untouched = [i for i in range(12) if i not in (10, 2)]
    assert torch.equal(pool[untouched], before[untouched])
    assert alloc.used_bytes == 0                            # staging freed


def test_staged_fp8_within_bound():
    src_lay, dst_lay = layout(block_size=4), layout(block_size=8)
    src_pool = pool_for(src_lay, 10, seed=2)
    pool, inbox, staging, _ = _receiver(dst_lay)
    _stage(inbox, staging, src_pool, src_lay, [1, 2, 7, 8], [0, 5], 16, fp8=True)
    assert len(inbox.take_ready()) == 1
    got = tokens_of(pool, [0, 5], 16)
    want = tokens_of(src_pool, [1, 2, 7, 8], 16)
    # bound per (block, layer, K/V) group of the sender's blocks: take the loosest
    bound = error_bound(compress(kv_pack(src_pool, [1, 2, 7, 8])).scales).max()
    err = (got - want).abs().max()
    assert 0 < err <= bound


def test_multi_shard_completes_after_every_rank():
    dst_lay = layout(heads=3)
    pool, inbox, staging, _ = _receiver(dst_lay)
    full = pool_for(dst_lay, 6, seed=3)
    for rank in range(3):
        src_lay = layout(heads=1, tp_size=3, tp_rank=rank, total=3)
        shard_pool = full[..., rank:rank + 1, :].contiguous()
        assert inbox.take_ready() == []
        _stage(inbox, staging, shard_pool, src_lay, [0, 1], [7, 8], 8,
               peer=f"prefill-{rank}")
    assert [a.request_id for a in inbox.take_ready()] == ["r1"]
    assert torch.equal(pool[[7, 8]], full[[0, 1]])


def test_cancelled_request_gets_no_staging():
    lay = layout()
    pool, inbox, _, alloc = _receiver(lay)
    before = pool.clone()
    inbox.cancel("r1")
    grant = inbox.on_stage_request("p", StageRequest(request_id="r1", nbytes=10,
                                                     instance_id="i"))
    assert grant.offset is None and "cancelled" in grant.error
    assert torch.equal(pool, before) and alloc.used_bytes == 0


def test_late_staged_arrival_after_cancel_is_dropped():
    lay = layout()
    src_pool = pool_for(lay, 4, seed=4)
    pool, inbox, staging, alloc = _receiver(lay)
    before = pool.clone()
    nbytes = staged_nbytes(lay, 1, False)
    grant = inbox.on_stage_request("p", StageRequest(request_id="r9", nbytes=nbytes,
                                                     instance_id="i"))
    inbox.cancel("r9")                       # the decode side gave up meanwhile
    staging[grant.offset:grant.offset + nbytes].copy_(
        kv_pack(src_pool, [0]).view(-1).view(torch.uint8))
    info = StagedInfo(offset=grant.offset, nbytes=nbytes, src_layout=lay, num_src_blocks=1,
                      num_tokens=4, dst_block_ids=[3])
    inbox.on_arrived("p", KvArrived(request_id="r9", staged=info))
    assert inbox.take_ready() == []
    assert torch.equal(pool, before) and alloc.used_bytes == 0


def test_bad_destination_fails_the_waiter():
    async def main():
        lay = layout()
        src_pool = pool_for(lay, 4, seed=6)
        _, inbox, staging, _ = _receiver(lay)
        fut = inbox.waiter("r1", asyncio.get_running_loop().create_future)
        _stage(inbox, staging, src_pool, lay, [0, 1], [99, 3], 8)
        with pytest.raises(TransferError, match="cannot rebuild"):
            await fut
    asyncio.run(main())


def test_staging_full_is_refused():
    _, inbox, _, _ = _receiver(layout())
    grant = inbox.on_stage_request("p", StageRequest(request_id="big", nbytes=STAGING + 1,
                                                     instance_id="i"))
    assert grant.offset is None and "staging full" in grant.error
