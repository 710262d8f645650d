"""The KV kernels compiled for CUDA against their torch references on the same GPU.

The same checks as ``tests/unit/kernels`` (which run the kernels under Triton's
interpreter), on larger shapes including the served model's block geometry.  Run this
file in its own process: Triton picks interpreted or compiled once per process.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    # skip before importing triton, so a CPU run keeps the interpreter for the unit tests
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from splitserve.kernels import kv_fp8, kv_layout, kv_pack
from splitserve.kernels.dispatch import kernels_interpreted

if kernels_interpreted():
    pytest.skip("triton was imported under TRITON_INTERPRET=1; run this file on its own",
                allow_module_level=True)

CUDA = torch.device("cuda")
# (num_blocks, layers, block_size, heads, head_dim, blocks in the request)
GEOMETRIES = [(64, 30, 16, 3, 64, 37), (29, 3, 5, 1, 12, 11), (300, 2, 7, 6, 80, 257)]


def _randn(*shape, seed, dtype=torch.bfloat16, scale=1.0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=CUDA) * scale).to(dtype)


def _request(geometry, seed, dtype=torch.bfloat16):
    num_blocks, layers, block_size, heads, head_dim, count = geometry
    pool = _randn(num_blocks, layers, 2, block_size, heads, head_dim, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    return pool, torch.randperm(num_blocks, generator=gen)[:count].tolist()


def _nan(shape, dtype=torch.bfloat16):
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=CUDA)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_unpack_round_trip(geometry, dtype):
    src, ids = _request(geometry, seed=1, dtype=dtype)
    out = _nan((len(ids), *src.shape[1:]), dtype)
    kv_pack.kv_pack(src, ids, out=out)
    assert not out.isnan().any()
    assert torch.equal(out, kv_pack.kv_pack_ref(src, ids))
    dst, _ = _request(geometry, seed=2, dtype=dtype)
    before = dst.clone()
    dst[ids] = float("nan")
    kv_pack.kv_unpack(out, dst, ids)
    assert torch.equal(dst[ids], src[ids])
    untouched = [b for b in range(dst.shape[0]) if b not in ids]
    assert torch.equal(dst[untouched], before[untouched])


@pytest.mark.parametrize(("geometry", "tokens", "layers"), [
    (GEOMETRIES[0], (5, 590), None), (GEOMETRIES[1], (3, 50), (1, 3)),
    (GEOMETRIES[2], (100, 1700), (0, 1)),
])
def test_token_ranges(geometry, tokens, layers):
    src, ids = _request(geometry, seed=3)
    l0, l1 = layers or (0, src.shape[1])
    out = _nan((l1 - l0, 2, tokens[1] - tokens[0], *src.shape[4:]))
    kv_pack.kv_pack_tokens(src, ids, *tokens, layers=layers, out=out)
    assert torch.equal(out, kv_pack.kv_pack_tokens_ref(src, ids, *tokens, layers))
    dst, _ = _request(geometry, seed=4)
    want = kv_pack.kv_unpack_tokens_ref(out, dst.clone(), ids, tokens[0], l0)
    assert torch.equal(kv_pack.kv_unpack_tokens(out, dst, ids, tokens[0], layer_start=l0), want)


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), [(8, 2, 4), (8, 4, 2), (3, 3, 1), (2, 1, 4)])
def test_reshard_heads(heads, src_tp, dst_tp):
    full = _randn(37, 30, 2, 16, heads, 64, seed=5)
    src = [kv_layout.reshard_heads_ref([full], heads, src_tp, r) for r in range(src_tp)]
    dst = []
    for rank in range(dst_tp):
        want = kv_layout.reshard_heads_ref([full], heads, dst_tp, rank)
        out = kv_layout.reshard_heads(src, heads, dst_tp, rank, out=_nan(want.shape))
        assert torch.equal(out, want)
        dst.append(out)
    for rank in range(src_tp):
        assert torch.equal(kv_layout.reshard_heads(dst, heads, src_tp, rank), src[rank])


@pytest.mark.parametrize(("bs_in", "bs_out", "n", "tokens"), [(16, 32, 37, 590), (16, 5, 9, 131)])
def test_rechunk(bs_in, bs_out, n, tokens):
    payload = _randn(n, 30, 2, bs_in, 3, 64, seed=6)
    shape = (-(-tokens // bs_out), 30, 2, bs_out, 3, 64)
    out = kv_layout.rechunk_blocks(payload, bs_out, num_tokens=tokens, out=_nan(shape))
    assert torch.equal(out, kv_layout.rechunk_blocks_ref(payload, bs_out, tokens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_bit_exact_and_bounded(dtype):
    shape = (37, 30, 2, 16, 3, 64)
    magnitude = 10.0 ** (torch.rand(*shape[:3], 1, 1, 1, device=CUDA) * 5 - 3)
    x = (_randn(*shape, seed=7, dtype=torch.float32) * magnitude).to(dtype)
    got = kv_fp8.compress(x)
    want = kv_fp8.compress_ref(x)
    assert torch.equal(got.scales, want.scales) and torch.equal(got.data, want.data)
    out = _nan(shape, dtype)
    kv_fp8.decompress(*got, dtype, out=out)
    assert torch.equal(out, kv_fp8.decompress_ref(*want, dtype))
    err = (out.float() - x.float()).abs().reshape(got.scales.numel(), -1).amax(dim=1)
    assert (err <= kv_fp8.error_bound(got.scales, dtype).flatten()).all()
