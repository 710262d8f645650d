"""Fused pack + FP8 compress: bit for bit ``compress(kv_pack(...))``, every code written."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import kv_fp8, kv_pack
from splitserve.kernels.kv_fp8 import Fp8Payload
from splitserve.kernels.kv_pack_fp8 import pack_compress, pack_compress_ref

from .kernel_factories import FLOAT_DTYPES, block_ids, nan_like, needs_interpreter

pytestmark = [pytest.mark.unit, needs_interpreter]

# (num_blocks, layers, block_size, heads, head_dim, blocks in the request)
GEOMETRIES = [
    (9, 2, 16, 3, 64, 3),     # the served model's slab: 3072 elements, one read
    (13, 3, 5, 1, 12, 5),     # 60-element slabs, nothing a power of two
    (17, 1, 7, 3, 9, 11),     # 189 elements: not a multiple of any vector width
]


def _kv_pool(geometry, seed, dtype):
    """Normal values whose magnitude varies per (block, layer, K/V) over 1e-3..1e2."""
    num_blocks, layers, block_size, heads, head_dim, _ = geometry
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layers, 2, block_size, heads, head_dim)
    magnitude = 10.0 ** (torch.rand(*shape[:3], 1, 1, 1, generator=gen) * 5 - 3)
    return (torch.randn(*shape, generator=gen) * magnitude).to(dtype)


def _sentinel_out(n, pool):
    """0xFF is an e4m3fn NaN code, which compress never emits (it clamps to +-448)."""
    return Fp8Payload(torch.full((n, *pool.shape[1:]), 0xFF, dtype=torch.uint8),
                      nan_like((n, *pool.shape[1:3])))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fused_equals_pack_then_compress_and_writes_everything(geometry, dtype):
    src = _kv_pool(geometry, seed=geometry[2], dtype=dtype)
    ids = block_ids(geometry[0], geometry[5], seed=geometry[0])
    out = _sentinel_out(len(ids), src)
    got = pack_compress(src, ids, out=out, backend="triton")
    assert got.data is out.data and got.scales is out.scales
    assert not (out.data == 0xFF).any()
    assert not out.scales.isnan().any()
    want = kv_fp8.compress_ref(kv_pack.kv_pack_ref(src, ids), group_ndim=3)
    assert torch.equal(out.scales, want.scales)
    assert torch.equal(out.data, want.data)


def test_two_pass_path_for_slabs_larger_than_one_step():
    geometry = GEOMETRIES[0]
    src = _kv_pool(geometry, seed=3, dtype=torch.bfloat16)
    ids = block_ids(geometry[0], geometry[5], seed=4)
    got = pack_compress(src, ids, block=256, backend="triton")     # 3072 = 12 steps
    want = pack_compress_ref(src, ids)
    assert torch.equal(got.scales, want.scales) and torch.equal(got.data, want.data)


def test_all_zero_slab_gets_unit_scale():
    geometry = GEOMETRIES[1]
    src = _kv_pool(geometry, seed=5, dtype=torch.float32)
    src[4, 1, 0] = 0.0
    got = pack_compress(src, [2, 4], backend="triton")
    assert got.scales[1, 1, 0].item() == 1.0 and not got.data[1, 1, 0].any()
    assert torch.equal(got.data, pack_compress_ref(src, [2, 4]).data)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_request_and_bad_arguments(backend):
    src = _kv_pool(GEOMETRIES[1], seed=6, dtype=torch.float32)
    empty = pack_compress(src, [], backend=backend)
    assert empty.data.shape == (0, *src.shape[1:]) and empty.scales.shape == (0, 3, 2)
    with pytest.raises(ValueError, match="dtype"):
        pack_compress(src.double(), [0], backend=backend)
    with pytest.raises(ValueError, match="out must"):
        pack_compress(src, [0, 1], out=_sentinel_out(1, src), backend=backend)
    with pytest.raises(IndexError, match="outside"):
        pack_compress(src, [13], backend=backend)
