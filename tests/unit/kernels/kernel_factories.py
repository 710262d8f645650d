"""Random KV tensors and shared marks for the kernel tests.

Inputs are fresh normal samples (never zeros) from a seeded generator; outputs are
pre-filled with NaN (or an impossible code) so a test can assert every element was written.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.dispatch import kernels_interpreted

needs_interpreter = pytest.mark.skipif(
    not kernels_interpreted(),
    reason="triton was imported in compiled mode in this process; run this folder alone")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32,
          scale: float = 1.0) -> torch.Tensor:
    """Normal samples ``* scale`` with a per-test seed, cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def pool(num_blocks: int, layers: int, block_size: int, heads: int, head_dim: int, *,
         seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random KV pool ``[num_blocks, L, 2, B, H, D]``."""
    return randn(num_blocks, layers, 2, block_size, heads, head_dim, seed=seed, dtype=dtype)


def block_ids(num_blocks: int, count: int, *, seed: int) -> list[int]:
    """``count`` distinct block ids in shuffled order, as a block table looks."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:count].tolist()


def nan_like(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output buffer whose every element still unwritten shows up as NaN."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


def assert_written(t: torch.Tensor) -> None:
    """Fails when a NaN sentinel survived, i.e. the kernel skipped an element."""
    assert not torch.isnan(t).any(), f"{int(torch.isnan(t).sum())} elements never written"
