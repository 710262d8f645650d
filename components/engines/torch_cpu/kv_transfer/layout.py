"""Pool layouts and the pure rule that picks the direct or the staged path.

A pool is ``[num_blocks, L, 2, B, H, D]`` and one block is one contiguous byte range.
Two agents can exchange raw blocks (the **direct path**) only when a block means the same
bytes on both sides: same layers, block size, local heads (the same global heads), head
dim and dtype.  When only the head sharding or the block size differs, the receiver can
rebuild its blocks from the sender's packed payload (the **staged path**).  Anything else
(layers, head dim, dtype, total heads) is a :class:`LayoutMismatch`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.kernels.kv_layout import head_plan, head_range

from .errors import LayoutMismatch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class PoolLayout(BaseModel):
    """What a block of one agent's pool holds; published in its etcd record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(ge=1, description="L: transformer layers per block.")
    block_size: int = Field(ge=1, description="B: tokens per block.")
    num_kv_heads: int = Field(ge=1, description="H: KV heads held locally (this TP rank).")
    head_dim: int = Field(ge=1, description="D: elements per head.")
    dtype: str = Field(description="Element type, one of float32, float16, bfloat16.")
    tp_size: int = Field(default=1, ge=1, description="Tensor-parallel degree of the worker.")
    tp_rank: int = Field(default=0, ge=0, description="This agent's rank in tp_size.")
    total_kv_heads: int = Field(ge=1, description="KV heads of the model (all ranks).")

    @model_validator(mode="after")
    def _check(self) -> PoolLayout:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        held = head_range(self.total_kv_heads, self.tp_size, self.tp_rank)
        if len(held) != self.num_kv_heads:
            raise ValueError(f"tp_rank {self.tp_rank} of tp_size {self.tp_size} holds "
                             f"{len(held)} of {self.total_kv_heads} heads, but the pool has "
                             f"num_kv_heads {self.num_kv_heads}")
        return self

    @classmethod
    def of_pool(cls, pool: torch.Tensor, *, tp_size: int = 1, tp_rank: int = 0,
                total_kv_heads: int | None = None) -> PoolLayout:
        """Called when an agent is created: the layout of a ``[N, L, 2, B, H, D]`` pool."""
        if pool.dim() != 6 or pool.shape[2] != 2 or not pool.is_contiguous():
            raise ValueError(f"pool must be a contiguous [N, L, 2, B, H, D] tensor, got "
                             f"{tuple(pool.shape)} contiguous={pool.is_contiguous()}")
        name = str(pool.dtype).removeprefix("torch.")
        _, layers, _, block_size, heads, head_dim = pool.shape
        return cls(num_layers=layers, block_size=block_size, num_kv_heads=heads,
                   head_dim=head_dim, dtype=name, tp_size=tp_size, tp_rank=tp_rank,
                   total_kv_heads=total_kv_heads or heads * tp_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block, ``(L, 2, B, H, D)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    def heads(self) -> range:
        """Global KV heads this rank holds."""
        return head_range(self.total_kv_heads, self.tp_size, self.tp_rank)


class TransformPlan(NamedTuple):
    """How a sender's blocks become the receiver's: the path and the receiver's steps."""

    path: str            # "direct" or "staged"
    reshard: bool        # receiver runs reshard_heads
    rechunk: bool        # receiver runs rechunk_blocks
    reasons: tuple[str, ...]


def same_layout(a: PoolLayout, b: PoolLayout) -> bool:
    """True when a block of ``a`` can be copied byte for byte into a block of ``b``."""
    return (a.num_layers, a.block_size, a.head_dim, a.dtype, list(a.heads())) == \
        (b.num_layers, b.block_size, b.head_dim, b.dtype, list(b.heads()))


def plan_transform(src: PoolLayout, dst: PoolLayout) -> TransformPlan:
    """Called by the sender before each write (and by tests): which path, which steps.

    Raises LayoutMismatch when no transform can make ``src`` blocks into ``dst`` blocks.
    """
    for field in ("num_layers", "head_dim", "dtype", "total_kv_heads"):
        if getattr(src, field) != getattr(dst, field):
            raise LayoutMismatch(f"{field} differs: sender {getattr(src, field)!r}, "
                                 f"receiver {getattr(dst, field)!r}")
    if same_layout(src, dst):
        return TransformPlan("direct", False, False, ("same layout",))
    reasons = []
    reshard = list(src.heads()) != list(dst.heads())
    rechunk = src.block_size != dst.block_size
    if reshard:
        reasons.append(f"heads: sender holds {_span(src)}, receiver {_span(dst)}")
    if rechunk:
        reasons.append(f"block_size: sender {src.block_size}, receiver {dst.block_size}")
    return TransformPlan("staged", reshard, rechunk, tuple(reasons))


def needed_src_ranks(src: PoolLayout, dst: PoolLayout) -> tuple[int, ...]:
    """Sender ranks (of ``src.tp_size``) whose heads the receiver rank ``dst`` needs.

    A sender whose rank is not listed skips the write; the receiver completes a staged
    request once every listed rank's shard has arrived.
    """
    plan = head_plan(dst.total_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank)
    return tuple(sorted({seg.src_rank for seg in plan}))


def dst_blocks_needed(num_tokens: int, dst: PoolLayout) -> int:
    """Receiver blocks that ``num_tokens`` tokens occupy."""
    return -(-num_tokens // dst.block_size)


def _span(layout: PoolLayout) -> str:
    heads = layout.heads()
    return f"{heads.start}..{heads.stop - 1} (tp {layout.tp_rank}/{layout.tp_size})"
