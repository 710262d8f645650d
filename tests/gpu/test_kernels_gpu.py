"""The KV kernels compiled for CUDA against their torch references on the same GPU.

The same checks as ``tests/unit/kernels`` (which run the kernels under Triton's
interpreter), on larger shapes including the served model's block geometry, with the
Triton path forced as well as automatic (small payloads dispatch to torch).  The last test
records the automatic pack/unpack against ``index_select``/``index_copy_`` in
``benchmarks/results/kernels_dispatch_<gpu>.json``: a measurement, not a timed assertion.
Run this file in its own process: Triton picks interpreted or compiled once per process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    # skip before importing triton, so a CPU run keeps the interpreter for the unit tests
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)

from splitserve.kernels import dispatch, kv_fp8, kv_layout, kv_pack
from splitserve.kernels.dispatch import kernels_interpreted
from splitserve.kernels.kv_pack_fp8 import pack_compress, pack_compress_ref

if kernels_interpreted():
    pytest.skip("triton was imported under TRITON_INTERPRET=1; run this file on its own",
                allow_module_level=True)

CUDA = torch.device("cuda")
# (num_blocks, layers, block_size, heads, head_dim, blocks in the request)
GEOMETRIES = [(64, 30, 16, 3, 64, 37), (29, 3, 5, 1, 12, 11), (300, 2, 7, 6, 80, 257),
              (41, 3, 5, 1, 7, 13)]     # 7-element heads: rows not a multiple of 4 bytes


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
@pytest.mark.parametrize("backend", [None, "triton"])
def test_pack_unpack_round_trip(geometry, dtype, backend):
    src, ids = _request(geometry, seed=1, dtype=dtype)
    out = _nan((len(ids), *src.shape[1:]), dtype)
    kv_pack.kv_pack(src, ids, out=out, backend=backend)
    assert not out.isnan().any()
    assert torch.equal(out, kv_pack.kv_pack_ref(src, ids))
    dst, _ = _request(geometry, seed=2, dtype=dtype)
    before = dst.clone()
    dst[ids] = float("nan")
    kv_pack.kv_unpack(out, dst, ids, backend=backend)
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
    # both are amax / 448 correctly rounded (exact in float64, then one rounding to fp32)
    amax = x.float().abs().amax(dim=(3, 4, 5)).double()
    assert torch.equal(got.scales, (amax / torch.full_like(amax, 448.0)).float())
    out = _nan(shape, dtype)
    kv_fp8.decompress(*got, dtype, out=out)
    assert torch.equal(out, kv_fp8.decompress_ref(*want, dtype))
    err = (out.float() - x.float()).abs().reshape(got.scales.numel(), -1).amax(dim=1)
    assert (err <= kv_fp8.error_bound(got.scales, dtype).flatten()).all()


@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[1], GEOMETRIES[3]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_pack_fp8_bit_exact(geometry, dtype):
    num_blocks, layers, block_size, heads, head_dim, count = geometry
    shape = (num_blocks, layers, 2, block_size, heads, head_dim)
    magnitude = 10.0 ** (torch.rand(*shape[:3], 1, 1, 1, device=CUDA) * 5 - 3)
    src = (_randn(*shape, seed=8, dtype=torch.float32) * magnitude).to(dtype)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(8))[:count].tolist()
    out = kv_fp8.Fp8Payload(torch.full((count, *shape[1:]), 0xFF, dtype=torch.uint8, device=CUDA),
                            _nan((count, layers, 2), torch.float32))
    pack_compress(src, ids, out=out)
    assert not (out.data == 0xFF).any() and not out.scales.isnan().any()
    want = pack_compress_ref(src, ids)
    assert torch.equal(out.scales, want.scales) and torch.equal(out.data, want.data)
    two_pass = kv_fp8.compress(kv_pack.kv_pack(src, ids, backend="triton"))
    assert torch.equal(out.data, two_pass.data) and torch.equal(out.scales, two_pass.scales)


def _best_seconds(fn, calls: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(calls):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return best


def _dispatch_row(mib: int) -> dict:
    """Best times of the automatic and forced pack/unpack and of torch's gather/scatter
    on a ``mib``-MiB payload of the served geometry (bf16)."""
    n = max(1, (mib << 20) // (30 * 2 * 16 * 3 * 64 * 2))
    pool = _randn(2 * n + 3, 30, 2, 16, 3, 64, seed=mib)
    ids = torch.randperm(pool.shape[0], device=CUDA)[:n]
    payload = torch.index_select(pool, 0, ids)
    buf, scratch = torch.empty_like(payload), pool.clone()
    best = {
        "copy": _best_seconds(lambda: buf.copy_(payload)),
        "index_select": _best_seconds(lambda: torch.index_select(pool, 0, ids, out=buf)),
        "pack": _best_seconds(lambda: kv_pack.kv_pack(pool, ids, out=buf)),
        "pack_triton": _best_seconds(lambda: kv_pack.kv_pack(pool, ids, out=buf,
                                                             backend="triton")),
        "index_copy": _best_seconds(lambda: scratch.index_copy_(0, ids, payload)),
        "unpack": _best_seconds(lambda: kv_pack.kv_unpack(payload, scratch, ids)),
        "unpack_triton": _best_seconds(lambda: kv_pack.kv_unpack(payload, scratch, ids,
                                                                 backend="triton")),
    }
    nbytes = payload.numel() * payload.element_size()
    return {"bytes": nbytes, "dispatch": kv_pack.pack_backend(pool, n), "best_s": best,
            "GBps": {k: nbytes / v / 1e9 for k, v in best.items()},
            "pack_vs_index_select": best["index_select"] / best["pack"],
            "unpack_vs_index_copy": best["index_copy"] / best["unpack"]}


def test_dispatch_against_index_select_is_recorded():
    """Records, per size, the automatic pack/unpack, the forced kernel and torch's
    index_select/index_copy_.  The dispatch should never be slower than index_select;
    this test keeps the figures rather than asserting on times that depend on the
    machine's load."""
    import triton

    rows = [_dispatch_row(mib) for mib in (1, 4, 16, 64, 256)]
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    out = Path(__file__).parents[2] / "benchmarks" / "results" / f"kernels_dispatch_{name}.json"
    out.write_text(json.dumps({"threshold_bytes": dispatch.TRITON_MIN_BYTES, "dtype": "bfloat16",
                               "triton": triton.__version__, "torch": torch.__version__,
                               "rows": rows}, indent=2) + "\n")
    assert [r["dispatch"] for r in rows] == [
        "triton" if r["bytes"] >= dispatch.TRITON_MIN_BYTES else "torch" for r in rows]
