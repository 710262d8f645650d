"""Pack and FP8-compress in one pass: the sender's compressed staged payload.

The compressed transfer path used to gather a request's blocks into a payload
(``kv_pack``) and then compress that payload (``kv_fp8.compress``): the payload was written
once and read once more (twice when a scale group did not fit in registers) only to be
thrown away.  :func:`pack_compress` reads each (block, layer, K/V) slab straight from the
pool through the block table, computes its scale and writes its e4m3 codes, so the bytes
touched are the pool's slabs once plus the codes: for bf16 1.5 bytes per element instead
of 2 + 2 + 2 + 1 = 7.

The result is bit for bit ``compress(kv_pack(pool, ids))`` with one scale per (block,
layer, K/V) (``group_ndim=3``): same scales (``amax / 448``, correctly rounded), same
codes (the shared encoder ``kv_fp8.e4m3_bits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import (
    LAUNCH_OPTIONS,
    Backend,
    as_index_tensor,
    launchable,
    persistent_grid,
    resolve_backend,
)
from .kv_fp8 import Fp8Payload, compress_ref, e4m3_bits, group_block, group_scale
from .kv_pack import BlockIds, check_pool, kv_pack_ref

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _pack_compress_kernel(
    pool_ptr,       # *T   [num_blocks, L*2, S]: the pool, S = B*H*D elements a slab
    ids_ptr,        # *i64 [n]: payload block i <- pool block ids[i]
    q_ptr,          # *u8  [n, L*2, S]: e4m3fn bit patterns
    scale_ptr,      # *f32 [n, L*2]: amax / 448 of each slab (1.0 if all zero)
    num_groups,     # n * L*2
    slabs,          # L*2: slabs per block
    group_numel,    # S
    BLOCK: tl.constexpr,   # elements per step; >= S means one read of the slab
):
    offs = tl.arange(0, BLOCK)
    # Persistent: program p handles slabs p, p + P, ...; one block-id load per slab.
    for g in range(tl.program_id(0), num_groups, tl.num_programs(0)):
        row = g // slabs
        blk = tl.load(ids_ptr + row)
        src = (blk * slabs + (g - row * slabs)) * group_numel     # int64
        dst = tl.cast(g, tl.int64) * group_numel              # g is int32 when compiled
        if BLOCK >= group_numel:
            mask = offs < group_numel
            x = tl.load(pool_ptr + src + offs, mask=mask, other=0).to(tl.float32)
            scale = group_scale(tl.max(tl.abs(x), axis=0))
            tl.store(scale_ptr + g, scale)
            tl.store(q_ptr + dst + offs, e4m3_bits(tl.div_rn(x, scale)).to(tl.uint8),
                     mask=mask)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, group_numel, BLOCK):    # pass 1: amax of the slab
                mask = start + offs < group_numel
                x = tl.load(pool_ptr + src + start + offs, mask=mask, other=0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
            scale = group_scale(tl.max(acc, axis=0))
            tl.store(scale_ptr + g, scale)
            for start in range(0, group_numel, BLOCK):    # pass 2: quantise
                mask = start + offs < group_numel
                x = tl.load(pool_ptr + src + start + offs, mask=mask, other=0).to(tl.float32)
                tl.store(q_ptr + dst + start + offs,
                         e4m3_bits(tl.div_rn(x, scale)).to(tl.uint8), mask=mask)


def pack_compress_ref(pool: torch.Tensor, block_ids: BlockIds) -> Fp8Payload:
    """Torch reference of :func:`pack_compress`: compress the packed payload, one scale
    per (block, layer, K/V)."""
    return compress_ref(kv_pack_ref(pool, block_ids), group_ndim=3)


def pack_compress(pool: torch.Tensor, block_ids: BlockIds, *, out: Fp8Payload | None = None,
                  block: int | None = None, backend: Backend | None = None) -> Fp8Payload:
    """Called by the sender of a compressed staged transfer instead of ``kv_pack`` then
    ``compress``.  Returns the codes ``[n, L, 2, B, H, D]`` (uint8) and scales
    ``[n, L, 2]`` (fp32), in ``out``'s tensors when given (e.g. views of a staging region).
    """
    check_pool(pool)
    if pool.dtype not in _DTYPES:
        raise ValueError(f"pool dtype must be one of {_DTYPES}, got {pool.dtype}")
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    n = ids.numel()
    shape, scale_shape = (n, *pool.shape[1:]), (n, *pool.shape[1:3])
    if out is None:
        out = Fp8Payload(torch.empty(shape, dtype=torch.uint8, device=pool.device),
                         torch.empty(scale_shape, dtype=torch.float32, device=pool.device))
    elif (tuple(out.data.shape) != shape or out.data.dtype != torch.uint8
          or tuple(out.scales.shape) != scale_shape or out.scales.dtype != torch.float32
          or not (out.data.is_contiguous() and out.scales.is_contiguous())):
        raise ValueError(f"out must hold contiguous uint8 codes {shape} and fp32 scales "
                         f"{scale_shape}")
    group_numel = pool[0, 0, 0].numel()
    if resolve_backend(pool, backend) == "torch" or not group_numel:
        ref = pack_compress_ref(pool, ids)
        out.data.copy_(ref.data)
        out.scales.copy_(ref.scales)
        return out
    if n:
        num_groups = n * 2 * pool.shape[1]
        grid = (persistent_grid(pool.device, num_groups),)
        launchable(_pack_compress_kernel, pool.device)[grid](
            pool, ids, out.data, out.scales, num_groups, 2 * pool.shape[1], group_numel,
            BLOCK=block or group_block(group_numel), **LAUNCH_OPTIONS)
    return out
