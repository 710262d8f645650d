"""The compressed staged payload the KV transfer builds comes from the fused kernel and is
bit for bit what packing then compressing gives, with its scales after the codes."""

from __future__ import annotations

import pytest
import torch

from splitserve.components.engines.torch_cpu.kv_transfer.layout import PoolLayout
from splitserve.components.engines.torch_cpu.kv_transfer.payload import build_fp8, staged_nbytes
from splitserve.kernels import kv_fp8, kv_pack

from .kernel_factories import FLOAT_DTYPES, block_ids, needs_interpreter, pool

pytestmark = [pytest.mark.unit, needs_interpreter]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_build_fp8_region_holds_codes_then_scales(dtype):
    src = pool(11, 3, 5, 3, 12, seed=21, dtype=dtype)
    ids = block_ids(11, 4, seed=22)
    layout = PoolLayout.of_pool(src)
    region = torch.full((staged_nbytes(layout, len(ids), fp8=True) + 64,), 0xFF, dtype=torch.uint8)
    sent = build_fp8(src, ids, layout, region)
    want = kv_fp8.compress_ref(kv_pack.kv_pack_ref(src, ids), group_ndim=3)
    codes = want.data.numel()
    scales_at = -(-codes // 8) * 8
    assert sent == scales_at + want.scales.numel() * 4
    assert torch.equal(region[:codes], want.data.flatten())
    assert torch.equal(region[scales_at:sent].view(torch.float32), want.scales.flatten())
    assert (region[sent:] == 0xFF).all()                  # nothing past the payload
