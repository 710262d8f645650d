"""Grouped-query attention over the paged KV cache, with batch-invariant rounding.

Every query row, whether it belongs to a prefill chunk or to a decode step,
goes through the same recipe:

1. scores against all keys of its sequence's (padded) context, one matmul
   whose reduction is over head_dim only;
2. masked (causal and past-the-end) entries become -inf, so their weights are
   exactly 0;
3. softmax numerator ``exp(s - max)``; the max is exact whatever the order;
4. weights times values and the normaliser summed tile by tile: each tile
   reduces over exactly ``tile`` keys, and tiles are added in position order.
   A tile past a row's last key adds an exact zero.

So a row's result depends only on its own query and keys, never on the chunk
size, the batch, or how far other sequences' contexts are padded. (A plain
SDPA call would reduce over a length that depends on the batch and could round
differently between the sequential and the batched run.)
"""

from __future__ import annotations

import torch


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor, tile: int
) -> torch.Tensor:
    """Core recipe. q [B, KVH, M, D]; k, v [B, C, KVH, D]; masked [B, 1, M, C] -> [B, KVH, M, D].

    C is a multiple of ``tile``.
    """
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, M, C]
    scores.masked_fill_(masked, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # [B, KVH, M, C]
    values = v.permute(0, 2, 1, 3)  # [B, KVH, C, D]
    out = None
    norm = None
    for t in range(0, weights.shape[-1], tile):
        w_t = weights[..., t : t + tile]  # [B, KVH, M, tile]
        part = torch.matmul(w_t, values[:, :, t : t + tile])  # [B, KVH, M, D]
        part_norm = w_t.sum(-1, keepdim=True)  # [B, KVH, M, 1]
        if out is None:
            out, norm = part, part_norm
        else:
            out = out + part
            norm = norm + part_norm
    return out / norm


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Collect blocks: cache [blocks, bs, KVH, D], tables [B, nb] -> [B, nb * bs, KVH, D]."""
    b, nb = tables.shape
    g = cache[tables]  # [B, nb, bs, KVH, D]
    return g.reshape(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    masked: torch.Tensor,
    tile: int,
) -> torch.Tensor:
    """Attention for one sequence's chunk of consecutive query positions.

    q [n, H, D] (already rotated; its K/V already written to the cache);
    k_cache, v_cache [blocks, bs, KVH, D] (one layer's view of the pool);
    block_table [nb] long, padded so nb * bs is a multiple of ``tile``;
    masked [n * G, nb * bs] bool, True where a key is after the query
    (see ``prefill_mask``). Returns [n, H * D].
    """
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    k = _gather(k_cache, block_table[None])  # [1, C, KVH, D]
    v = _gather(v_cache, block_table[None])
    qg = q.view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, n * group, dim)
    out = _attend(qg, k, v, masked[None, None], tile)  # [1, KVH, n * G, D]
    return out.view(kv_heads, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads * dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    masked: torch.Tensor,
    tile: int,
) -> torch.Tensor:
    """Attention for one new token of each of B sequences, batched.

    q [B, H, D]; block_tables [B, nb] long, padded (with any valid block id)
    so nb * bs is a multiple of ``tile``; masked [B, nb * bs] bool, True past
    each sequence's last key (see ``decode_mask``). Returns [B, H * D].
    """
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = _gather(k_cache, block_tables)  # [B, C, KVH, D]
    v = _gather(v_cache, block_tables)
    qg = q.view(b, kv_heads, heads // kv_heads, dim)  # [B, KVH, G, D]
    out = _attend(qg, k, v, masked[:, None, None, :], tile)  # [B, KVH, G, D]
    return out.reshape(b, heads * dim)


def prefill_mask(positions: torch.Tensor, num_keys: int, group: int) -> torch.Tensor:
    """Causal mask [n * G, num_keys] for query positions [n]; built once per step, not per layer."""
    row_pos = positions.repeat_interleave(group)  # [n * G]
    return torch.arange(num_keys)[None, :] > row_pos[:, None]


def decode_mask(context_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Past-the-end mask [B, num_keys] for decode rows with ``context_lens`` [B] keys."""
    return torch.arange(num_keys)[None, :] >= context_lens[:, None]
