"""Layout transforms between the prefill and decode sides of a KV transfer.

Payloads are ``[n, L, 2, B, H, D]`` as produced by ``kv_pack``.  Two mismatches occur:

* **Head sharding.**  With tensor parallelism of degree ``tp`` a rank holds only its KV
  heads (:func:`head_range`).  When the prefill side runs ``tp_p`` and the decode side
  ``tp_d``, :func:`reshard_heads` builds the payload of one decode rank
  ``[n, L, 2, B, H_d, D]`` from the ``tp_p`` prefill payloads ``[n, L, 2, B, H_p, D]``,
  concatenating or splitting along the head axis.
* **Block size.**  :func:`rechunk_blocks` re-cuts the token axis from ``B_a`` to ``B_b``
  tokens per block, zero-filling the slots past the request's last token.

Both are copies of ``H*D``-element rows, so each kernel moves a tile of rows per program,
as 32-bit words with 16-byte vector hints when the geometry allows (``dispatch.copy_unit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dispatch import LAUNCH_OPTIONS, Backend, as_units, copy_unit, launchable, resolve_backend


@triton.jit
def _head_copy_kernel(
    src_ptr,          # *U [rows, src_row_units]: source payload as units, rows = n*L*2*B
    dst_ptr,          # *U [rows, dst_row_units]: destination payload as units
    num_rows,         # n*L*2*B
    src_row_units,    # H_src * D elements, as units
    dst_row_units,    # H_dst * D elements, as units
    src_col0,         # first source unit of the segment
    dst_col0,         # where the segment lands in a destination row
    num_cols,         # segment length in units
    VEC: tl.constexpr,      # every length and offset above is a multiple of VEC units
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # units per program along a row (power of two >= 16)
):
    if VEC > 1:   # (an argument equal to 1 arrives as a constant)
        num_cols = tl.multiple_of(num_cols, VEC)   # masks keep VEC-wide accesses
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)   # [BLOCK_R]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                  # [BLOCK_C]
    mask = (r < num_rows)[:, None] & (c < num_cols)[None, :]
    src_at = tl.multiple_of(r * src_row_units + src_col0, VEC)
    dst_at = tl.multiple_of(r * dst_row_units + dst_col0, VEC)
    vals = tl.load(src_ptr + src_at[:, None] + c[None, :], mask=mask)
    tl.store(dst_ptr + dst_at[:, None] + c[None, :], vals, mask=mask)


@triton.jit
def _rechunk_kernel(
    src_ptr,          # *U [n_a*L*2*B_a, row_units]: source payload as rows of units
    dst_ptr,          # *U [n_b*L*2*B_b, row_units]: destination payload as rows
    num_rows,         # n_b*L*2*B_b
    num_tokens,       # T: tokens of the request; later slots are zero-filled
    num_lk,           # 2*L: (layer, k/v) pairs per block
    bs_in,            # B_a
    bs_out,           # B_b
    row_units,        # H*D elements, as units
    VEC: tl.constexpr,      # row_units is a multiple of VEC units
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # units per program along a row (power of two >= 16)
):
    if VEC > 1:   # (an argument equal to 1 arrives as a constant)
        row_units = tl.multiple_of(row_units, VEC)   # masks keep VEC-wide accesses
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)   # [BLOCK_R]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)                  # [BLOCK_C]
    slot = r % bs_out
    lk = (r // bs_out) % num_lk
    tok = (r // (bs_out * num_lk)) * bs_out + slot           # request token of the row
    src_row = ((tok // bs_in) * num_lk + lk) * bs_in + tok % bs_in
    col_ok = (c < row_units)[None, :]
    row_ok = r < num_rows
    load_mask = (row_ok & (tok < num_tokens))[:, None] & col_ok
    src_at = tl.multiple_of(src_row * row_units, VEC)
    dst_at = tl.multiple_of(r * row_units, VEC)
    vals = tl.load(src_ptr + src_at[:, None] + c[None, :], mask=load_mask, other=0)
    tl.store(dst_ptr + dst_at[:, None] + c[None, :], vals, mask=row_ok[:, None] & col_ok)


def _tiles(row_units: int) -> tuple[int, int]:
    """Tile shape for row copies: whole rows up to 4096 units, ~4096 units (16 KiB of
    32-bit words) a tile."""
    block_c = min(max(triton.next_power_of_2(row_units), 16), 4096)
    return max(1, 4096 // block_c), block_c


# ---------------------------------------------------------------- head sharding

def head_range(num_kv_heads: int, tp: int, rank: int) -> range:
    """Global KV heads held by ``rank`` of a ``tp``-way sharded worker.

    ``tp <= H``: ``H % tp == 0`` and rank r holds ``H/tp`` consecutive heads.
    ``tp > H``: ``tp % H == 0`` and each head is replicated on ``tp/H`` consecutive ranks.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp={tp}")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads do not split over tp={tp}")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of {num_kv_heads} KV heads")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


class HeadSegment(NamedTuple):
    """``count`` heads copied from ``src_rank``'s local head ``src_head`` to local
    destination head ``dst_head``."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def head_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSegment]:
    """Pure copy plan of :func:`reshard_heads`: which source heads fill ``dst_rank``.

    Consecutive heads from one source rank merge into one segment; a replicated head is
    read from its first holder.
    """
    owner: dict[int, tuple[int, int]] = {}
    for rank in range(src_tp):
        for local, head in enumerate(head_range(num_kv_heads, src_tp, rank)):
            owner.setdefault(head, (rank, local))
    plan: list[HeadSegment] = []
    for dst_local, head in enumerate(head_range(num_kv_heads, dst_tp, dst_rank)):
        rank, local = owner[head]
        last = plan[-1] if plan else None
        if last and last.src_rank == rank and last.src_head + last.count == local:
            plan[-1] = last._replace(count=last.count + 1)
        else:
            plan.append(HeadSegment(rank, local, dst_local, 1))
    return plan


def reshard_heads_ref(shards: Sequence[torch.Tensor], num_kv_heads: int, dst_tp: int,
                      dst_rank: int) -> torch.Tensor:
    """Torch reference of :func:`reshard_heads`, built head by head."""
    src_tp = len(shards)
    holders = {}
    for rank in reversed(range(src_tp)):     # reversed: the first holder wins
        for local, head in enumerate(head_range(num_kv_heads, src_tp, rank)):
            holders[head] = shards[rank][..., local, :]
    return torch.stack([holders[h] for h in head_range(num_kv_heads, dst_tp, dst_rank)], dim=4)


def reshard_heads(shards: Sequence[torch.Tensor], num_kv_heads: int, dst_tp: int,
                  dst_rank: int, *, out: torch.Tensor | None = None,
                  backend: Backend | None = None) -> torch.Tensor:
    """Called on either side when the tensor-parallel degrees differ.

    ``shards[r]`` is source rank r's payload ``[n, L, 2, B, H_src, D]`` (``src_tp =
    len(shards)``).  Returns destination rank ``dst_rank``'s payload
    ``[n, L, 2, B, H_dst, D]``, every element written.
    """
    first = shards[0]
    src_tp = len(shards)
    h_src = len(head_range(num_kv_heads, src_tp, 0))
    for shard in shards:
        if (shard.dim() != 6 or shard.shape[4] != h_src or shard.shape != first.shape
                or shard.dtype != first.dtype or shard.device != first.device):
            raise ValueError(f"every shard must be [n, L, 2, B, {h_src}, D] like the first, "
                             f"{tuple(first.shape)} {first.dtype}; got {tuple(shard.shape)}")
    plan = head_plan(num_kv_heads, src_tp, dst_tp, dst_rank)
    shape = (*first.shape[:4], len(head_range(num_kv_heads, dst_tp, dst_rank)), first.shape[5])
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    elif tuple(out.shape) != shape or out.dtype != first.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {first.dtype}")
    if resolve_backend(first, backend) == "torch":
        return out.copy_(reshard_heads_ref(shards, num_kv_heads, dst_tp, dst_rank))
    head_bytes, num_rows = first.shape[5] * first.element_size(), first[..., 0, 0].numel()
    kernel = launchable(_head_copy_kernel, first.device)
    srcs = [shard.contiguous() for shard in shards]
    # One unit for every segment: head-sized offsets, whole rows and all tensors' addresses.
    unit, vec = copy_unit([head_bytes], [*srcs, out])
    per_head = head_bytes // unit.itemsize
    dst_units, src_units = as_units(out, unit), [as_units(t, unit) for t in srcs]
    for seg in plan:
        num_cols = seg.count * per_head
        block_r, block_c = _tiles(num_cols)
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(num_cols, block_c))
        if num_rows:
            kernel[grid](src_units[seg.src_rank], dst_units, num_rows, h_src * per_head,
                         shape[4] * per_head, seg.src_head * per_head, seg.dst_head * per_head,
                         num_cols, VEC=vec, BLOCK_R=block_r, BLOCK_C=block_c, **LAUNCH_OPTIONS)
    return out


# ---------------------------------------------------------------- block size

def rechunk_blocks_ref(payload: torch.Tensor, block_size_out: int,
                       num_tokens: int | None = None) -> torch.Tensor:
    """Torch reference of :func:`rechunk_blocks`."""
    n, layers, _, bs_in, heads, head_dim = payload.shape
    num_tokens = n * bs_in if num_tokens is None else num_tokens
    n_out = -(-num_tokens // block_size_out)
    tokens = payload.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, n * bs_in, heads, head_dim)
    padded = payload.new_zeros(layers, 2, n_out * block_size_out, heads, head_dim)
    padded[:, :, :num_tokens] = tokens[:, :, :num_tokens]
    blocks = padded.reshape(layers, 2, n_out, block_size_out, heads, head_dim)
    return blocks.permute(2, 0, 1, 3, 4, 5).contiguous()


def rechunk_blocks(payload: torch.Tensor, block_size_out: int, *,
                   num_tokens: int | None = None, out: torch.Tensor | None = None,
                   backend: Backend | None = None) -> torch.Tensor:
    """Called when the two sides use different block sizes.

    ``payload`` is ``[n_a, L, 2, B_a, H, D]`` holding ``num_tokens`` tokens (default
    ``n_a*B_a``).  Returns ``[ceil(num_tokens / B_b), L, 2, B_b, H, D]`` with
    ``B_b = block_size_out``; slots past ``num_tokens`` are zero.
    """
    if payload.dim() != 6 or payload.shape[2] != 2:
        raise ValueError(f"payload must be [n, L, 2, B, H, D], got {tuple(payload.shape)}")
    n, layers, _, bs_in, heads, head_dim = payload.shape
    num_tokens = n * bs_in if num_tokens is None else num_tokens
    if block_size_out < 1 or not 0 <= num_tokens <= n * bs_in:
        raise ValueError(f"need block_size_out >= 1 and 0 <= num_tokens <= {n * bs_in}; "
                         f"got {block_size_out}, {num_tokens}")
    shape = (-(-num_tokens // block_size_out), layers, 2, block_size_out, heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=payload.dtype, device=payload.device)
    elif tuple(out.shape) != shape or out.dtype != payload.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {payload.dtype}")
    if resolve_backend(payload, backend) == "torch":
        return out.copy_(rechunk_blocks_ref(payload, block_size_out, num_tokens))
    src = payload.contiguous()
    unit, vec = copy_unit([heads * head_dim * payload.element_size()], [src, out])
    num_rows, row_units = out[..., 0, 0].numel(), heads * head_dim * payload.element_size()
    row_units //= unit.itemsize
    block_r, block_c = _tiles(row_units)
    if num_rows:
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(row_units, block_c))
        launchable(_rechunk_kernel, payload.device)[grid](
            as_units(src, unit), as_units(out, unit), num_rows, num_tokens, 2 * layers, bs_in,
            block_size_out, row_units, VEC=vec, BLOCK_R=block_r, BLOCK_C=block_c,
            **LAUNCH_OPTIONS)
    return out
