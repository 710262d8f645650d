"""Layout records, the direct/staged decision and the sender ranks a receiver needs."""

from __future__ import annotations

import pytest
import torch

from splitserve.components.engines.torch_cpu.kv_transfer import (
    LayoutMismatch,
    PoolLayout,
    needed_src_ranks,
    plan_transform,
    same_layout,
)

from .factories import layout

pytestmark = pytest.mark.unit


def test_of_pool_reads_dims():
    pool = torch.randn(5, 30, 2, 16, 3, 64)
    lay = PoolLayout.of_pool(pool)
    assert lay.block_shape == (30, 2, 16, 3, 64)
    assert lay.block_bytes == 737_280
    assert (lay.tp_size, lay.total_kv_heads) == (1, 3)


def test_of_pool_rejects_bad_shapes():
    with pytest.raises(ValueError, match="contiguous"):
        PoolLayout.of_pool(torch.randn(5, 2, 3, 4, 3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        PoolLayout.of_pool(torch.randn(5, 2, 2, 4, 8, 3).transpose(4, 5))


def test_layout_checks_heads_against_tp():
    with pytest.raises(ValueError, match="holds 1 of 3 heads"):
        layout(heads=3, tp_size=3, tp_rank=0, total=3)
    with pytest.raises(ValueError, match="dtype"):
        layout(dtype="int8")


@pytest.mark.parametrize(("src", "dst", "path", "reshard", "rechunk"), [
    (layout(), layout(), "direct", False, False),
    (layout(heads=1, tp_size=3, tp_rank=1), layout(heads=1, tp_size=3, tp_rank=1),
     "direct", False, False),
    (layout(), layout(heads=1, tp_size=3, tp_rank=2, total=3), "staged", True, False),
    (layout(heads=1, tp_size=3, tp_rank=0), layout(), "staged", True, False),
    (layout(block_size=4), layout(block_size=8), "staged", False, True),
    (layout(block_size=16), layout(block_size=8, heads=1, tp_size=3, tp_rank=0),
     "staged", True, True),
    # same local head count, different heads: rank 0 vs rank 1 of tp=3
    (layout(heads=1, tp_size=3, tp_rank=0), layout(heads=1, tp_size=3, tp_rank=1),
     "staged", True, False),
])
def test_plan_transform(src, dst, path, reshard, rechunk):
    plan = plan_transform(src, dst)
    assert (plan.path, plan.reshard, plan.rechunk) == (path, reshard, rechunk)
    assert same_layout(src, dst) == (path == "direct")
    assert plan.reasons


@pytest.mark.parametrize("field", [{"layers": 3}, {"head_dim": 16}, {"dtype": "bfloat16"},
                                   {"heads": 6}])
def test_plan_transform_rejects_incompatible(field):
    with pytest.raises(LayoutMismatch):
        plan_transform(layout(), layout(**field))


@pytest.mark.parametrize(("src_tp", "dst_tp", "dst_rank", "ranks"), [
    (1, 3, 1, (0,)),
    (3, 1, 0, (0, 1, 2)),
    (3, 3, 2, (2,)),
    (6, 3, 1, (2,)),      # 6 ranks replicate 3 heads: the first holder is read
])
def test_needed_src_ranks(src_tp, dst_tp, dst_rank, ranks):
    def lay(tp, rank):
        held = max(1, 3 // tp)
        return layout(heads=held, tp_size=tp, tp_rank=rank, total=3)
    assert needed_src_ranks(lay(src_tp, 0), lay(dst_tp, dst_rank)) == ranks
