"""FP8 e4m3 compression: bit-exact against torch's cast, and within the error bound."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import kv_fp8
from splitserve.kernels.kv_fp8 import Fp8Payload

from .kernel_factories import FLOAT_DTYPES, assert_written, nan_like, needs_interpreter, randn

pytestmark = [pytest.mark.unit, needs_interpreter]

SHAPES = [(2, 3, 2, 16, 3, 64), (3, 2, 2, 5, 1, 12), (1, 1, 2, 7, 3, 9)]


def _sentinel_out(shape, group_ndim):
    """0xFF is an e4m3fn NaN code, which compress never emits (it clamps to +-448)."""
    return Fp8Payload(torch.full(shape, 0xFF, dtype=torch.uint8), nan_like(shape[:group_ndim]))


def _kv_like(shape, seed, dtype=torch.float32):
    """Normal values whose magnitude varies per (block, layer, K/V) over 1e-3..1e2."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(*shape[:3], 1, 1, 1, generator=gen) * 5 - 3)
    return (torch.randn(*shape, generator=gen) * magnitude).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_compress_is_bit_exact_and_writes_every_code(shape, dtype):
    x = _kv_like(shape, seed=len(shape) + shape[3], dtype=dtype)
    out = _sentinel_out(shape, 3)
    kv_fp8.compress(x, out=out, backend="triton")
    assert not (out.data == 0xFF).any()
    assert_written(out.scales)
    want = kv_fp8.compress_ref(x)
    assert torch.equal(out.scales, want.scales)
    assert torch.equal(out.data, want.data)


@pytest.mark.parametrize(("shape", "group_ndim"), [
    ((2, 3, 2, 5, 3, 12), 1),     # one scale per block
    ((3, 2, 11, 3, 12), 2),       # token payload [L', 2, T, H, D]: per layer and K/V
    ((4, 2, 7), 0),               # a single scale
])
def test_other_scale_granularities(shape, group_ndim):
    x = randn(*shape, seed=5, scale=3.0)
    got = kv_fp8.compress(x, group_ndim=group_ndim, backend="triton")
    want = kv_fp8.compress_ref(x, group_ndim)
    assert got.scales.shape == shape[:group_ndim]
    assert torch.equal(got.scales, want.scales) and torch.equal(got.data, want.data)


def test_rounding_matches_torch_on_every_code_and_every_tie():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.sort(codes[torch.isfinite(codes)]).values               # all 253 values
    ties = (grid[1:] + grid[:-1]) / 2
    up, down = torch.full_like(ties, 1e9), torch.full_like(ties, -1e9)
    x = torch.cat([grid, ties, ties.nextafter(up), ties.nextafter(down)]).reshape(1, -1)
    got = kv_fp8.compress(x, group_ndim=0, backend="triton")
    assert got.scales.item() == 1.0                                       # amax is 448
    assert torch.equal(got.data, kv_fp8.compress_ref(x, 0).data)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_decompress_matches_reference_and_writes_every_element(dtype):
    x = _kv_like(SHAPES[1], seed=7, dtype=dtype)
    packed = kv_fp8.compress_ref(x)
    out = nan_like(x.shape, dtype)
    kv_fp8.decompress(packed.data, packed.scales, dtype, out=out, backend="triton")
    assert_written(out)
    assert torch.equal(out, kv_fp8.decompress_ref(packed.data, packed.scales, dtype))


def _max_error_over_bound(x, dtype, group_ndim=3):
    packed = kv_fp8.compress(x, group_ndim=group_ndim, backend="triton")
    y = kv_fp8.decompress(*packed, dtype, backend="triton")
    err = (y.float() - x.float()).abs().reshape(packed.scales.numel(), -1).amax(dim=1)
    return (err / kv_fp8.error_bound(packed.scales, dtype).flatten()).max().item()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", ["uniform", "normal", "kv-like"])
def test_round_trip_error_within_documented_bound(dtype, kind):
    shape = SHAPES[0]
    gen = torch.Generator().manual_seed(11)
    x = {"uniform": lambda: torch.rand(*shape, generator=gen) * 2 - 1,
         "normal": lambda: torch.randn(*shape, generator=gen),
         "kv-like": lambda: _kv_like(shape, seed=11)}[kind]().to(dtype)
    ratio = _max_error_over_bound(x, dtype)
    assert 0.5 < ratio <= 1.0           # within the bound, and the bound is not loose


def test_per_layer_scales_protect_quiet_slabs():
    x = randn(2, 4, 2, 16, 3, 64, seed=13)
    x[:, 0] *= 1e5                        # one layer far louder than the rest
    quiet = x[:, 1:]
    rel_rms = {}
    for group_ndim in (1, 3):             # per block vs per (block, layer, K/V)
        y = kv_fp8.decompress(*kv_fp8.compress(x, group_ndim=group_ndim, backend="triton"),
                              backend="triton")
        rel_rms[group_ndim] = ((y[:, 1:] - quiet).pow(2).mean() / quiet.pow(2).mean()).sqrt()
    assert rel_rms[3] < 0.03
    assert rel_rms[1] > 0.3


def test_all_zero_group_gets_unit_scale_and_round_trips():
    x = randn(2, 1, 2, 4, 1, 8, seed=17)
    x[1, 0, 1] = 0.0
    packed = kv_fp8.compress(x, backend="triton")
    assert packed.scales[1, 0, 1].item() == 1.0
    assert not kv_fp8.decompress(*packed, backend="triton")[1, 0, 1].any()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        kv_fp8.compress(torch.ones(2, 2, 2, dtype=torch.float64))
    packed = kv_fp8.compress_ref(randn(2, 2, 2, 3, seed=3))
    with pytest.raises(ValueError, match="lead"):
        kv_fp8.decompress(packed.data, packed.scales[:1])
