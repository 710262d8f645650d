"""Small numerical building blocks of the forward pass.

Every op here gives each row a result that does not depend on which other rows
share the call. That is what lets a request's greedy output stay identical
whether it runs alone or batched with 31 others (see ``Linear``).
"""

from __future__ import annotations

import torch

# Inner dimension above which a matmul is split into fixed chunks. MKL's sgemm
# picks a K-blocking that depends on M once K is large (1536 here), which
# changes per-row rounding with batch size; at K <= 768 it does not.
_MAX_K_CHUNK = 768
# Rows of every matmul are padded to a multiple of this. On AVX2-only CPUs (AMD EPYC
# seen) MKL rounds rows differently for some row counts even on the NN path (16 of 70
# rows differed), and M = 1 always takes a GEMV path; with M a multiple of 4 each row's
# result was bitwise the same for every batch size from 1 to 300 there (on the AVX-512
# machines measured before, the NN path was M-invariant for every M already).
_ROW_MULTIPLE = 4


class Linear:
    """``y = x @ W^T (+ b)`` with batch-invariant rounding.

    Built once at load time from a ``[out, in]`` weight. Three measured rules
    keep each output row bitwise independent of how many rows are computed:
    the weight is stored transposed and contiguous (``[in, out]``: MKL's NN
    path is M-invariant where its NT path is not); rows are padded with zeros
    to a multiple of 4 (M = 1 takes a GEMV path that rounds differently, and on
    AVX2-only CPUs some other M do too); K is split into fixed
    chunks of at most 768 whose partial products are added in a fixed order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        wt = weight.detach().to(torch.float32).t().contiguous()  # [in, out]
        # Added after the product, row by row: batch-invariant like the rest.
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        n_chunks = -(-wt.shape[0] // _MAX_K_CHUNK)
        size = -(-wt.shape[0] // n_chunks)
        self.in_features = wt.shape[0]
        self.out_features = wt.shape[1]
        self.bounds = [(s, min(s + size, wt.shape[0])) for s in range(0, wt.shape[0], size)]
        self.chunks = [wt[a:b].contiguous() for a, b in self.bounds]  # each [k_chunk, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to ``x`` [rows, in]; returns [rows, out]."""
        rows = x.shape[0]
        pad = -rows % _ROW_MULTIPLE
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        if len(self.chunks) == 1:
            y = x @ self.chunks[0]
        else:
            (a, b), w = self.bounds[0], self.chunks[0]
            y = x[:, a:b] @ w
            for (a, b), w in zip(self.bounds[1:], self.chunks[1:], strict=True):
                y += x[:, a:b] @ w
        if self.bias is not None:
            y += self.bias
        return y[:rows] if pad else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., n] -> [..., n] (weight [n]): the hidden state,
    or each head's query and key (Qwen3's per-head norms)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def default_inv_freq(head_dim: int, theta: float) -> tuple[float, ...]:
    """RoPE's unscaled inverse frequencies ``theta ** (-2i / head_dim)``, computed as
    transformers computes them."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return tuple((1.0 / (theta**exps)).tolist())


def rope_tables(
    inv_freq: tuple[float, ...], max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute cos and sin, each [max_positions, head_dim], for rotate-half RoPE.

    ``inv_freq`` [head_dim / 2] carries the checkpoint's scaling (linear, llama3, yarn);
    ``attention_scaling`` multiplies both tables (yarn's). Called once at load. Tables
    (instead of computing per step) keep RoPE to multiplies and adds, which round the
    same for every row.
    """
    inv = torch.tensor(inv_freq, dtype=torch.float32)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv)  # [max_positions, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim] by per-row cos/sin [rows, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
