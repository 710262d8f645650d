"""Gather a request's KV blocks into one contiguous payload, and scatter it back.

Pool layout (fixed by the engine): ``[num_blocks, L, 2, B, H, D]`` with L layers, K/V,
B tokens per block, H KV heads, D head dim; one block is one contiguous region of
``L*2*B*H*D`` elements.  The prefill worker calls :func:`kv_pack` to merge a request's
small, scattered cache blocks into one transfer payload ``[n, L, 2, B, H, D]``; the
decode worker calls :func:`kv_unpack` to write that payload into its own block ids.

:func:`kv_pack_tokens` / :func:`kv_unpack_tokens` move a token range of a layer range
instead, as ``[L', 2, T, H, D]``, for layer-wise streaming or for sending only the tokens
the other side lacks.

Each entry point takes ``backend=None`` (automatic, see ``dispatch``), ``"triton"`` or
``"torch"``; the ``*_ref`` functions are the torch references the kernels are tested on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .dispatch import (
    LAUNCH_OPTIONS,
    Backend,
    as_index_tensor,
    as_units,
    copy_unit,
    launchable,
    persistent_grid,
    resolve_backend,
    resolve_copy_backend,
)

BlockIds = Sequence[int] | torch.Tensor


@triton.jit
def _blocks_kernel(
    pool_ptr,        # *U   [num_blocks, row_units]: the pool's bytes as units, a block a row
    payload_ptr,     # *U   [n, row_units]: the contiguous payload
    ids_ptr,         # *i64 [n]: payload row i <-> pool row ids[i]
    num_rows,        # n
    row_units,       # units in one block
    GATHER: tl.constexpr,  # True: pool -> payload (pack); False: payload -> pool (unpack)
    VEC: tl.constexpr,     # row_units and both base addresses are multiples of VEC units
    BLOCK: tl.constexpr,   # units per tile
):
    # Persistent: program p copies tiles p, p + P, ... of the (row, chunk) tiles, so a
    # launch has a few programs per SM whatever the payload, each with many 16-byte
    # accesses in flight; a block id is one scalar load per tile.
    if VEC > 1:   # (an argument equal to 1 arrives as a constant)
        row_units = tl.multiple_of(row_units, VEC)   # masks keep VEC-wide accesses
    chunks = tl.cdiv(row_units, BLOCK)
    cols = tl.arange(0, BLOCK)
    for tile in range(tl.program_id(0), num_rows * chunks, tl.num_programs(0)):
        row = tile // chunks
        offs = (tile - row * chunks) * BLOCK + cols
        mask = offs < row_units
        blk = tl.load(ids_ptr + row)                        # int64: offsets can pass 2**31
        pool_at = tl.multiple_of(blk * row_units, VEC)
        payload_at = tl.multiple_of(row.to(tl.int64) * row_units, VEC)
        if GATHER:
            vals = tl.load(pool_ptr + pool_at + offs, mask=mask)
            tl.store(payload_ptr + payload_at + offs, vals, mask=mask)
        else:
            vals = tl.load(payload_ptr + payload_at + offs, mask=mask)
            tl.store(pool_ptr + pool_at + offs, vals, mask=mask)


@triton.jit
def _tokens_kernel(
    pool_ptr,        # *U   pool as rows of one token's heads: [num_blocks*L*2*B, row_units]
    payload_ptr,     # *U   [L'*2*T, row_units]: rows ordered (layer', k/v, token)
    ids_ptr,         # *i64 block table of the request
    num_rows,        # L'*2*T
    num_tokens,      # T
    token_start,     # first token of the range, counted from the request's start
    layer_start,     # first layer of the range
    num_layers,      # L of the pool
    block_size,      # B
    row_units,       # H*D elements as units
    GATHER: tl.constexpr,   # True: pool -> payload; False: payload -> pool
    VEC: tl.constexpr,      # row_units and both base addresses are multiples of VEC units
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # units per program along a row (power of two >= 16)
):
    if VEC > 1:   # (an argument equal to 1 arrives as a constant)
        row_units = tl.multiple_of(row_units, VEC)   # masks keep VEC-wide accesses
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)   # [BLOCK_R] payload rows
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)   # [BLOCK_C] units
    row_ok = r < num_rows
    tok = r % num_tokens
    lk = r // num_tokens                                     # layer' * 2 + kv
    pos = token_start + tok
    blk = tl.load(ids_ptr + pos // block_size, mask=row_ok, other=0)   # [BLOCK_R] int64
    pool_row = (blk * num_layers * 2 + layer_start * 2 + lk) * block_size + pos % block_size
    mask = row_ok[:, None] & (c < row_units)[None, :]
    pool_at = tl.multiple_of(pool_row * row_units, VEC)
    payload_at = tl.multiple_of(r.to(tl.int64) * row_units, VEC)
    pool_offs = pool_at[:, None] + c[None, :]                # [BLOCK_R, BLOCK_C]
    payload_offs = payload_at[:, None] + c[None, :]
    if GATHER:
        vals = tl.load(pool_ptr + pool_offs, mask=mask)
        tl.store(payload_ptr + payload_offs, vals, mask=mask)
    else:
        vals = tl.load(payload_ptr + payload_offs, mask=mask)
        tl.store(pool_ptr + pool_offs, vals, mask=mask)


# ---------------------------------------------------------------- torch references

def kv_pack_ref(pool: torch.Tensor, block_ids: BlockIds) -> torch.Tensor:
    """Torch reference of :func:`kv_pack`: returns ``pool[block_ids]``, contiguous."""
    return pool.index_select(0, as_index_tensor(block_ids, pool.shape[0], pool.device))


def kv_unpack_ref(payload: torch.Tensor, pool: torch.Tensor,
                  block_ids: BlockIds) -> torch.Tensor:
    """Torch reference of :func:`kv_unpack`: ``pool[block_ids] = payload``; returns pool."""
    return pool.index_copy_(0, as_index_tensor(block_ids, pool.shape[0], pool.device), payload)


def _token_index(pool, block_ids, token_start, num_tokens, layer_start, num_layers):
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    pos = token_start + torch.arange(num_tokens, device=pool.device)
    block_size = pool.shape[3]
    layer = torch.arange(layer_start, layer_start + num_layers, device=pool.device)
    # advanced indices [T, 1], [1, L'], [T, 1] around a slice -> result [T, L', 2, H, D]
    return ids[pos // block_size][:, None], layer[None, :], slice(None), (pos % block_size)[:, None]


def kv_pack_tokens_ref(pool, block_ids, token_start, token_end, layers=None) -> torch.Tensor:
    """Torch reference of :func:`kv_pack_tokens`; returns ``[L', 2, T, H, D]``."""
    l0, l1 = layers or (0, pool.shape[1])
    index = _token_index(pool, block_ids, token_start, token_end - token_start, l0, l1 - l0)
    return pool[index].permute(1, 2, 0, 3, 4).contiguous()


def kv_unpack_tokens_ref(payload, pool, block_ids, token_start, layer_start=0) -> torch.Tensor:
    """Torch reference of :func:`kv_unpack_tokens`; writes into ``pool`` and returns it."""
    index = _token_index(pool, block_ids, token_start, payload.shape[2], layer_start,
                         payload.shape[0])
    pool[index] = payload.permute(2, 0, 1, 3, 4)
    return pool


# ---------------------------------------------------------------- wrappers

def check_pool(pool: torch.Tensor) -> None:
    """Called by every wrapper taking a pool: refuses anything but a contiguous
    ``[num_blocks, L, 2, B, H, D]``."""
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(f"pool must be [num_blocks, L, 2, B, H, D], got {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous: a block is one contiguous region")


# Units per tile of the whole-block kernel: 16 KiB, 32 words (8 x 16 bytes) per thread.
TILE_UNITS = 4096


def _launch_blocks(pool, payload, ids, gather: bool, block: int | None) -> None:
    block_bytes = math.prod(pool.shape[1:]) * pool.element_size()
    unit, vec = copy_unit([block_bytes], [pool, payload])
    row_units = block_bytes // unit.itemsize
    block = block or min(TILE_UNITS, triton.next_power_of_2(max(row_units, 16)))
    tiles = ids.numel() * triton.cdiv(row_units, block)
    grid = (persistent_grid(pool.device, tiles),)
    launchable(_blocks_kernel, pool.device)[grid](
        as_units(pool, unit), as_units(payload, unit), ids, ids.numel(), row_units,
        GATHER=gather, VEC=vec, BLOCK=block, **LAUNCH_OPTIONS)


def pack_backend(pool: torch.Tensor, num_blocks: int, backend: Backend | None = None) -> Backend:
    """Which path :func:`kv_pack` / :func:`kv_unpack` take for ``num_blocks`` blocks of
    ``pool``: on CUDA torch below ``dispatch.TRITON_MIN_BYTES``, the kernel above."""
    nbytes = num_blocks * math.prod(pool.shape[1:]) * pool.element_size()
    return resolve_copy_backend(pool, backend, nbytes)


def kv_pack(pool: torch.Tensor, block_ids: BlockIds, *, out: torch.Tensor | None = None,
            backend: Backend | None = None, block: int | None = None) -> torch.Tensor:
    """Called by the prefill side before a transfer; returns the payload
    ``[len(block_ids), L, 2, B, H, D]`` (``out`` when given, e.g. a registered buffer).
    ``block``: units (see ``dispatch.copy_unit``) per tile, for tests."""
    check_pool(pool)
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    shape = (ids.numel(), *pool.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    elif tuple(out.shape) != shape or out.dtype != pool.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {pool.dtype}")
    if pack_backend(pool, ids.numel(), backend) == "torch":
        return torch.index_select(pool, 0, ids, out=out)
    if ids.numel():
        _launch_blocks(pool, out, ids, True, block)
    return out


def kv_unpack(payload: torch.Tensor, pool: torch.Tensor, block_ids: BlockIds, *,
              backend: Backend | None = None, block: int | None = None) -> torch.Tensor:
    """Called by the decode side when a payload lands; writes ``payload[i]`` into block
    ``block_ids[i]`` of ``pool`` (ids must be distinct) and returns ``pool``."""
    check_pool(pool)
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    if tuple(payload.shape) != (ids.numel(), *pool.shape[1:]) or payload.dtype != pool.dtype:
        raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not fit "
                         f"{ids.numel()} blocks of {tuple(pool.shape[1:])} {pool.dtype}")
    if pack_backend(pool, ids.numel(), backend) == "torch":
        return pool.index_copy_(0, ids, payload)
    if ids.numel():
        _launch_blocks(pool, payload.contiguous(), ids, False, block)
    return pool


def _launch_tokens(pool, payload, ids, token_start, layer_start, gather: bool) -> None:
    num_layers_out, _, num_tokens, heads, head_dim = payload.shape
    row_bytes = heads * head_dim * pool.element_size()
    unit, vec = copy_unit([row_bytes], [pool, payload])
    row_units = row_bytes // unit.itemsize
    block_c = min(max(triton.next_power_of_2(row_units), 16), TILE_UNITS)
    block_r = max(1, TILE_UNITS // block_c)
    num_rows = num_layers_out * 2 * num_tokens
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(row_units, block_c))
    launchable(_tokens_kernel, pool.device)[grid](
        as_units(pool, unit), as_units(payload, unit), ids, num_rows, num_tokens, token_start,
        layer_start, pool.shape[1], pool.shape[3], row_units, GATHER=gather, VEC=vec,
        BLOCK_R=block_r, BLOCK_C=block_c, **LAUNCH_OPTIONS)


def _check_range(pool, n_ids, token_start, token_end, l0, l1) -> None:
    if not 0 <= token_start <= token_end <= n_ids * pool.shape[3]:
        raise ValueError(f"tokens [{token_start}, {token_end}) outside the "
                         f"{n_ids * pool.shape[3]} slots of {n_ids} blocks")
    if not 0 <= l0 <= l1 <= pool.shape[1]:
        raise ValueError(f"layers [{l0}, {l1}) outside [0, {pool.shape[1]})")


def kv_pack_tokens(pool: torch.Tensor, block_ids: BlockIds, token_start: int, token_end: int,
                   *, layers: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                   backend: Backend | None = None) -> torch.Tensor:
    """Called to send part of a request's KV: tokens ``[token_start, token_end)`` (counted
    from the request's first token) of layers ``[l0, l1)`` (all by default).  Returns
    ``[l1 - l0, 2, token_end - token_start, H, D]``."""
    check_pool(pool)
    l0, l1 = layers or (0, pool.shape[1])
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    _check_range(pool, ids.numel(), token_start, token_end, l0, l1)
    shape = (l1 - l0, 2, token_end - token_start, *pool.shape[4:])
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    elif tuple(out.shape) != shape or out.dtype != pool.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {shape} {pool.dtype}")
    if resolve_backend(pool, backend) == "torch":
        return out.copy_(kv_pack_tokens_ref(pool, ids, token_start, token_end, (l0, l1)))
    if out.numel():
        _launch_tokens(pool, out, ids, token_start, l0, True)
    return out


def kv_unpack_tokens(payload: torch.Tensor, pool: torch.Tensor, block_ids: BlockIds,
                     token_start: int, *, layer_start: int = 0,
                     backend: Backend | None = None) -> torch.Tensor:
    """Called when a token-range payload ``[L', 2, T, H, D]`` lands: writes it at tokens
    ``[token_start, token_start + T)`` and layers ``[layer_start, layer_start + L')``
    of the request's blocks; returns ``pool``."""
    check_pool(pool)
    ids = as_index_tensor(block_ids, pool.shape[0], pool.device)
    n_layers, _, n_tokens = payload.shape[:3]
    _check_range(pool, ids.numel(), token_start, token_start + n_tokens, layer_start,
                 layer_start + n_layers)
    if payload.shape[1] != 2 or payload.shape[3:] != pool.shape[4:] or payload.dtype != pool.dtype:
        raise ValueError(f"payload {tuple(payload.shape)} {payload.dtype} does not match "
                         f"pool {tuple(pool.shape)} {pool.dtype}")
    if resolve_backend(pool, backend) == "torch":
        return kv_unpack_tokens_ref(payload, pool, ids, token_start, layer_start)
    if payload.numel():
        _launch_tokens(pool, payload.contiguous(), ids, token_start, layer_start, False)
    return pool
