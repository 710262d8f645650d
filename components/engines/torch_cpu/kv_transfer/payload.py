"""Staged payloads: their byte size, the FP8 form, and the receiver's rebuild.

A staged payload is what ``kv_pack(pool, src_ids)`` returns, ``[n, L, 2, B, H, D]``; with
FP8 it is the uint8 codes (same shape) followed, at the next 8-byte boundary, by the fp32
scales ``[n, L, 2]``.  These functions take tensors only; no NIXL, no etcd.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from splitserve.kernels.kv_fp8 import Fp8Payload, decompress
from splitserve.kernels.kv_layout import rechunk_blocks, reshard_heads
from splitserve.kernels.kv_pack import kv_unpack
from splitserve.kernels.kv_pack_fp8 import pack_compress

from .layout import PoolLayout, dst_blocks_needed, plan_transform
from .messages import StagedInfo


def _fp8_parts(layout: PoolLayout, n: int) -> tuple[int, int, int]:
    """(codes bytes, scales offset, scales bytes) of an FP8 payload of ``n`` blocks."""
    codes = n * math.prod(layout.block_shape)
    scales_at = -(-codes // 8) * 8
    return codes, scales_at, n * layout.num_layers * 2 * 4


def staged_nbytes(layout: PoolLayout, n: int, fp8: bool) -> int:
    """Bytes a staged payload of ``n`` sender blocks takes in the staging pool."""
    if not fp8:
        return n * layout.block_bytes
    _, scales_at, scales = _fp8_parts(layout, n)
    return scales_at + scales


def build_fp8(pool: torch.Tensor, src_ids: Sequence[int], layout: PoolLayout,
              region: torch.Tensor) -> int:
    """Sender, FP8 option: pack and compress ``src_ids`` into ``region`` (uint8, at least
    :func:`staged_nbytes` long, 8-byte aligned) in one pass; returns the bytes to send."""
    n = len(src_ids)
    codes, scales_at, scales = _fp8_parts(layout, n)
    out = Fp8Payload(region[:codes].view(n, *layout.block_shape),
                     region[scales_at:scales_at + scales].view(torch.float32)
                     .view(n, layout.num_layers, 2))
    pack_compress(pool, list(src_ids), out=out)   # one scale per (block, layer, K/V)
    return scales_at + scales


def read_staged(region: torch.Tensor, info: StagedInfo) -> torch.Tensor:
    """Receiver: the sender's payload ``[n, L, 2, B, H_src, D]`` in the sender's dtype,
    copied out of ``region`` (uint8) so the staging region can be freed at once."""
    src, n = info.src_layout, info.num_src_blocks
    if not info.fp8:
        flat = region[:n * src.block_bytes].view(src.torch_dtype)
        return flat.view(n, *src.block_shape).clone()
    codes, scales_at, scales = _fp8_parts(src, n)
    data = region[:codes].view(n, *src.block_shape)
    sc = region[scales_at:scales_at + scales].view(torch.float32).view(n, src.num_layers, 2)
    return decompress(data, sc, src.torch_dtype)


def rebuild(shards: Mapping[int, torch.Tensor], src: PoolLayout, dst: PoolLayout,
            num_tokens: int) -> torch.Tensor:
    """Receiver: turn the sender ranks' payloads (rank -> tensor, the ranks in
    ``needed_src_ranks``) into ``dst``'s payload ``[ceil(T / B_dst), L, 2, B_dst, H_dst, D]``."""
    plan = plan_transform(src, dst)
    if plan.reshard:
        # reshard_heads wants one tensor per sender rank; ranks the plan does not read
        # are filled with any received shard (same shape, never read).
        filler = next(iter(shards.values()))
        payload = reshard_heads([shards.get(r, filler) for r in range(src.tp_size)],
                                dst.total_kv_heads, dst.tp_size, dst.tp_rank)
    else:
        payload = shards[src.tp_rank]
    if plan.rechunk or payload.shape[0] != dst_blocks_needed(num_tokens, dst):
        payload = rechunk_blocks(payload, dst.block_size, num_tokens=num_tokens)
    return payload


def unpack_into(pool: torch.Tensor, payload: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """Receiver: write the rebuilt payload into its blocks (the last step of a staged
    request)."""
    if payload.shape[0] != len(dst_ids):
        raise ValueError(f"payload has {payload.shape[0]} blocks for {len(dst_ids)} ids")
    kv_unpack(payload, pool, list(dst_ids))
