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
    """``y = x @ W^T`` with batch-invariant rounding.

    Built once at load time from a ``[out, in]`` weight. Three measured rules
    keep each output row bitwise independent of how many rows are computed:
    the weight is stored transposed and contiguous (``[in, out]``: MKL's NN
    path is M-invariant where its NT path is not); rows are padded with zeros
    to a multiple of 4 (M = 1 takes a GEMV path that rounds differently, and on
    AVX2-only CPUs some other M do too); K is split into fixed
    chunks of at most 768 whose partial products are added in a fixed order.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        wt = weight.detach().to(torch.float32).t().contiguous()  # [in, out]
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
        return y[:rows] if pad else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [rows, hidden] -> [rows, hidden]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precompute cos and sin, each [max_positions, head_dim], for rotate-half RoPE.

    Called once at load. Tables (instead of computing per step) keep RoPE to
    multiplies and adds, which round the same for every row.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_positions, dtype=torch.float32) / scaling_factor
    freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim] by per-row cos/sin [rows, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
