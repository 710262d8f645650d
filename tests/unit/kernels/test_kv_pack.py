"""kv_pack / kv_unpack (whole blocks) and the token-range variants against torch."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import kv_pack

from .kernel_factories import (
    FLOAT_DTYPES,
    assert_written,
    block_ids,
    nan_like,
    needs_interpreter,
    pool,
)

pytestmark = [pytest.mark.unit, needs_interpreter]

# (num_blocks, layers, block_size, heads, head_dim, blocks in the request)
GEOMETRIES = [
    (9, 2, 16, 3, 64, 3),     # the served model's B, H, D with fewer layers
    (13, 3, 5, 1, 12, 5),     # nothing a power of two
    (7, 1, 3, 6, 20, 1),
    (17, 2, 7, 3, 9, 11),
]


def _request(geometry, seed, dtype=torch.float32):
    num_blocks, layers, block_size, heads, head_dim, count = geometry
    return (pool(num_blocks, layers, block_size, heads, head_dim, seed=seed, dtype=dtype),
            block_ids(num_blocks, count, seed=seed + 1))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("block", [2048, 64])
def test_pack_matches_reference_and_writes_every_element(geometry, block):
    src, ids = _request(geometry, seed=10)
    out = nan_like((len(ids), *src.shape[1:]))
    got = kv_pack.kv_pack(src, ids, out=out, backend="triton", block=block)
    assert got is out
    assert_written(out)
    assert torch.equal(out, kv_pack.kv_pack_ref(src, ids))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_pack_keeps_half_precision_bits(dtype):
    src, ids = _request(GEOMETRIES[1], seed=20, dtype=dtype)
    assert torch.equal(kv_pack.kv_pack(src, ids, backend="triton"), kv_pack.kv_pack_ref(src, ids))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_unpack_round_trip_touches_only_the_given_blocks(geometry):
    src, ids = _request(geometry, seed=30)
    dst = pool(*geometry[:5], seed=31)
    before = dst.clone()
    dst[ids] = float("nan")                                  # must all be overwritten
    kv_pack.kv_unpack(kv_pack.kv_pack(src, ids, backend="triton"), dst, ids, backend="triton")
    assert_written(dst)
    assert torch.equal(dst[ids], src[ids])
    untouched = [b for b in range(dst.shape[0]) if b not in ids]
    assert torch.equal(dst[untouched], before[untouched])


def test_unpack_matches_reference_into_other_block_ids():
    src, ids = _request(GEOMETRIES[3], seed=40)
    payload = kv_pack.kv_pack_ref(src, ids)
    targets = block_ids(src.shape[0], len(ids), seed=41)     # decode side: its own ids
    got = kv_pack.kv_unpack(payload, pool(*GEOMETRIES[3][:5], seed=42), targets, backend="triton")
    want = kv_pack.kv_unpack_ref(payload, pool(*GEOMETRIES[3][:5], seed=42), targets)
    assert torch.equal(got, want)


# (geometry, token range, layer range or None)
TOKEN_CASES = [
    (GEOMETRIES[0], (0, 48), None),
    (GEOMETRIES[1], (3, 22), (1, 3)),        # starts and ends mid-block
    (GEOMETRIES[3], (20, 21), (1, 2)),       # one token of one layer
    (GEOMETRIES[3], (6, 77), None),
]


def _tokens_by_slicing(src, ids, tokens, layers):
    """Independent reference: token-major view of the whole-block payload, sliced."""
    payload = kv_pack.kv_pack_ref(src, ids)
    n, num_layers, _, block_size, heads, head_dim = payload.shape
    flat = payload.permute(1, 2, 0, 3, 4, 5).reshape(num_layers, 2, n * block_size, heads, head_dim)
    l0, l1 = layers or (0, num_layers)
    return flat[l0:l1, :, tokens[0]:tokens[1]]


@pytest.mark.parametrize(("geometry", "tokens", "layers"), TOKEN_CASES)
def test_pack_tokens_matches_both_references(geometry, tokens, layers):
    src, ids = _request(geometry, seed=50)
    l0, l1 = layers or (0, src.shape[1])
    out = nan_like((l1 - l0, 2, tokens[1] - tokens[0], *src.shape[4:]))
    kv_pack.kv_pack_tokens(src, ids, *tokens, layers=layers, out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_pack.kv_pack_tokens_ref(src, ids, *tokens, layers))
    assert torch.equal(out, _tokens_by_slicing(src, ids, tokens, layers))


@pytest.mark.parametrize(("geometry", "tokens", "layers"), TOKEN_CASES)
def test_unpack_tokens_round_trip_touches_only_that_range(geometry, tokens, layers):
    src, ids = _request(geometry, seed=60)
    payload = kv_pack.kv_pack_tokens_ref(src, ids, *tokens, layers)
    dst = pool(*geometry[:5], seed=61)
    want = kv_pack.kv_unpack_tokens_ref(payload, dst.clone(), ids, tokens[0], (layers or (0,))[0])
    got = kv_pack.kv_unpack_tokens(payload, dst, ids, tokens[0],
                                   layer_start=(layers or (0,))[0], backend="triton")
    assert torch.equal(got, want)
    assert torch.equal(kv_pack.kv_pack_tokens(got, ids, *tokens, layers=layers), payload)
    changed = (got != pool(*geometry[:5], seed=61)).any(dim=(4, 5)).sum().item()
    assert changed <= payload.numel() // (payload.shape[3] * payload.shape[4])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_shapes_and_ranges_are_refused(backend):
    src, ids = _request(GEOMETRIES[1], seed=70)
    with pytest.raises(ValueError, match="does not fit"):
        kv_pack.kv_unpack(torch.ones(2, *src.shape[1:]), src, ids, backend=backend)
    with pytest.raises(ValueError, match="outside"):
        kv_pack.kv_pack_tokens(src, ids, 0, len(ids) * src.shape[3] + 1, backend=backend)
    with pytest.raises(ValueError, match="contiguous"):
        kv_pack.kv_pack(src.transpose(0, 1), ids, backend=backend)


def _misaligned_pool(geometry, dtype, seed):
    """A pool starting one element past a 16-byte boundary: the kernels must fall back to
    narrower units (int16 for 2-byte dtypes) and still copy every element."""
    src = pool(*geometry[:5], seed=seed, dtype=dtype)
    flat = torch.empty(src.numel() + 16, dtype=dtype)
    skip = (-flat.data_ptr() // src.element_size()) % (16 // src.element_size()) + 1
    moved = flat[skip:skip + src.numel()].view(src.shape)
    moved.copy_(src)
    return moved


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("geometry", [GEOMETRIES[1], GEOMETRIES[3]])
@pytest.mark.parametrize("misaligned", [False, True])
def test_pack_unpack_every_dtype_and_alignment(dtype, geometry, misaligned):
    src = (_misaligned_pool(geometry, dtype, seed=80) if misaligned
           else pool(*geometry[:5], seed=80, dtype=dtype))
    ids = block_ids(geometry[0], geometry[5], seed=81)
    out = nan_like((len(ids), *src.shape[1:]), dtype)
    kv_pack.kv_pack(src, ids, out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_pack.kv_pack_ref(src, ids))
    dst = _misaligned_pool(geometry, dtype, seed=82) if misaligned else pool(
        *geometry[:5], seed=82, dtype=dtype)
    want = kv_pack.kv_unpack_ref(out, dst.clone(), ids)
    assert torch.equal(kv_pack.kv_unpack(out, dst, ids, backend="triton"), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tokens_with_odd_row_bytes(dtype):
    geometry = (11, 2, 5, 1, 7, 4)                           # a row is 14 bytes: int16 units
    src, ids = _request(geometry, seed=90, dtype=dtype)
    out = nan_like((1, 2, 13, 1, 7), dtype)
    kv_pack.kv_pack_tokens(src, ids, 4, 17, layers=(1, 2), out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_pack.kv_pack_tokens_ref(src, ids, 4, 17, (1, 2)))
    want = kv_pack.kv_unpack_tokens_ref(out, src.clone(), ids, 2, 0)
    assert torch.equal(kv_pack.kv_unpack_tokens(out, src, ids, 2, backend="triton"), want)
