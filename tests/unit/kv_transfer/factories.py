"""Small builders for the KV transfer unit tests."""

from __future__ import annotations

import torch

from splitserve.components.engines.torch_cpu.kv_transfer import PoolLayout


def layout(*, layers=2, block_size=4, heads=3, head_dim=8, dtype="float32", tp_size=1,
           tp_rank=0, total=None) -> PoolLayout:
    return PoolLayout(num_layers=layers, block_size=block_size, num_kv_heads=heads,
                      head_dim=head_dim, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank,
                      total_kv_heads=total or heads * tp_size)


def pool_for(lay: PoolLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A random pool (never zeros) of ``lay``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *lay.block_shape, generator=gen).to(lay.torch_dtype)


def tokens_of(pool: torch.Tensor, block_ids, num_tokens: int) -> torch.Tensor:
    """The request's KV as ``[L, 2, T, H, D]`` (reference for layout checks)."""
    blocks = pool[list(block_ids)]                     # [n, L, 2, B, H, D]
    n, layers, _, bs, heads, dim = blocks.shape
    return blocks.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, n * bs, heads, dim)[:, :, :num_tokens]
