"""Head resharding between tensor-parallel degrees and block-size re-chunking."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import kv_layout
from splitserve.kernels.kv_layout import HeadSegment

from .kernel_factories import assert_written, nan_like, needs_interpreter, randn

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("heads", "tp", "rank", "expected"), [
    (3, 1, 0, range(3)),
    (3, 3, 2, range(2, 3)),
    (6, 2, 1, range(3, 6)),
    (2, 4, 1, range(1)),       # tp > heads: each head replicated on tp/heads ranks
    (2, 4, 2, range(1, 2)),
])
def test_head_range(heads, tp, rank, expected):
    assert kv_layout.head_range(heads, tp, rank) == expected


@pytest.mark.parametrize(("heads", "tp", "rank"), [(3, 2, 0), (2, 3, 0), (4, 2, 2)])
def test_head_range_refuses_uneven_splits(heads, tp, rank):
    with pytest.raises(ValueError):
        kv_layout.head_range(heads, tp, rank)


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp", "dst_rank", "plan"), [
    (6, 3, 2, 1, [HeadSegment(1, 1, 0, 1), HeadSegment(2, 0, 1, 2)]),
    (6, 1, 3, 2, [HeadSegment(0, 4, 0, 2)]),
    (4, 4, 1, 0, [HeadSegment(r, 0, r, 1) for r in range(4)]),
    (2, 4, 1, 0, [HeadSegment(0, 0, 0, 1), HeadSegment(2, 0, 1, 1)]),   # first replica read
])
def test_head_plan(heads, src_tp, dst_tp, dst_rank, plan):
    assert kv_layout.head_plan(heads, src_tp, dst_tp, dst_rank) == plan


def _shards(full, heads, tp):
    return [kv_layout.reshard_heads_ref([full], heads, tp, r) for r in range(tp)]


@needs_interpreter
@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), [
    (6, 1, 3), (6, 3, 2), (6, 2, 3), (4, 4, 1), (3, 1, 3), (3, 3, 1), (2, 2, 4), (2, 4, 1),
])
def test_reshard_matches_reference_and_inverts(heads, src_tp, dst_tp):
    full = randn(3, 2, 2, 5, heads, 12, seed=heads * 10 + src_tp)    # [n, L, 2, B, H, D]
    src = _shards(full, heads, src_tp)
    dst = []
    for rank in range(dst_tp):
        want = kv_layout.reshard_heads_ref([full], heads, dst_tp, rank)
        out = nan_like(want.shape)
        kv_layout.reshard_heads(src, heads, dst_tp, rank, out=out, backend="triton")
        assert_written(out)
        assert torch.equal(out, want)
        dst.append(out)
    for rank in range(src_tp):
        assert torch.equal(kv_layout.reshard_heads(dst, heads, src_tp, rank, backend="triton"),
                           src[rank])


def test_reshard_refuses_mismatched_shards():
    a = randn(2, 1, 2, 4, 3, 8, seed=1)
    with pytest.raises(ValueError, match="every shard"):
        kv_layout.reshard_heads([a, a[:1]], 6, 1, 0)


# (source block size, destination block size, source blocks, tokens)
RECHUNKS = [(16, 5, 3, 41), (5, 16, 7, 35), (3, 7, 4, 12), (16, 16, 2, 32), (4, 6, 5, 1)]


@needs_interpreter
@pytest.mark.parametrize(("bs_in", "bs_out", "n", "tokens"), RECHUNKS)
def test_rechunk_matches_reference_and_inverts(bs_in, bs_out, n, tokens):
    payload = randn(n, 2, 2, bs_in, 3, 10, seed=bs_in * 100 + bs_out)
    shape = (-(-tokens // bs_out), 2, 2, bs_out, 3, 10)
    out = nan_like(shape)
    kv_layout.rechunk_blocks(payload, bs_out, num_tokens=tokens, out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_layout.rechunk_blocks_ref(payload, bs_out, tokens))
    back = kv_layout.rechunk_blocks(out, bs_in, num_tokens=tokens, backend="triton")
    as_tokens = back.permute(1, 2, 0, 3, 4, 5).reshape(2, 2, -1, 3, 10)
    original = payload.permute(1, 2, 0, 3, 4, 5).reshape(2, 2, -1, 3, 10)
    assert torch.equal(as_tokens[:, :, :tokens], original[:, :, :tokens])
    assert not as_tokens[:, :, tokens:].any()                # padding slots are zero


@pytest.mark.parametrize(("bs_out", "tokens"), [(0, 4), (4, 99)])
def test_rechunk_refuses_bad_arguments(bs_out, tokens):
    with pytest.raises(ValueError, match="block_size_out"):
        kv_layout.rechunk_blocks(randn(2, 1, 2, 4, 1, 8, seed=2), bs_out, num_tokens=tokens)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [5, 8])                 # 10-byte heads: int16 units
def test_half_precision_layouts_with_odd_head_bytes(dtype, head_dim):
    full = randn(3, 2, 2, 5, 6, head_dim, seed=head_dim, dtype=dtype)
    src = _shards(full, 6, 2)
    for rank in range(3):
        want = kv_layout.reshard_heads_ref([full], 6, 3, rank)
        out = nan_like(want.shape, dtype)
        kv_layout.reshard_heads(src, 6, 3, rank, out=out, backend="triton")
        assert_written(out)
        assert torch.equal(out, want)
    out = nan_like((4, 2, 2, 4, 6, head_dim), dtype)
    kv_layout.rechunk_blocks(full, 4, num_tokens=13, out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_layout.rechunk_blocks_ref(full, 4, 13))
