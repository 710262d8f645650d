"""Run merging and descriptor building."""

from __future__ import annotations

import pytest

from splitserve.components.engines.torch_cpu.kv_transfer import BlockRun, merge_runs, run_descs, staged_runs
from splitserve.components.engines.torch_cpu.kv_transfer.descriptors import check_block_ids

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("src", "dst", "runs"), [
    ([], [], []),
    ([3], [10], [BlockRun(3, 10, 1)]),
    ([3, 4, 5, 9], [10, 11, 12, 2], [BlockRun(3, 10, 3), BlockRun(9, 2, 1)]),
    ([0, 1, 2, 3], [7, 8, 20, 21], [BlockRun(0, 7, 2), BlockRun(2, 20, 2)]),
    ([5, 4, 3], [0, 1, 2], [BlockRun(5, 0, 1), BlockRun(4, 1, 1), BlockRun(3, 2, 1)]),
    ([1, 2, 7, 8], [4, 5, 6, 7], [BlockRun(1, 4, 2), BlockRun(7, 6, 2)]),
])
def test_merge_runs(src, dst, runs):
    assert merge_runs(src, dst) == runs
    # the runs describe exactly the same pairs, in order
    pairs = [(r.src_start + i, r.dst_start + i) for r in runs for i in range(r.count)]
    assert pairs == list(zip(src, dst, strict=True))


def test_merge_runs_needs_equal_lengths():
    with pytest.raises(ValueError, match="3 source blocks but 2"):
        merge_runs([1, 2, 3], [1, 2])


def test_staged_runs_fill_consecutive_slots():
    assert staged_runs([3, 4, 5, 9]) == [BlockRun(3, 0, 3), BlockRun(9, 3, 1)]


def test_run_descs_addresses():
    runs = merge_runs([3, 4, 5, 9], [10, 11, 12, 2])
    local, remote = run_descs(runs, src_base=1000, dst_base=50_000, block_bytes=100,
                              dst_device=1)
    assert local == [(1300, 300, 0), (1900, 100, 0)]
    assert remote == [(51_000, 300, 1), (50_200, 100, 1)]
    assert sum(d[1] for d in local) == sum(d[1] for d in remote) == 400


@pytest.mark.parametrize(("ids", "msg"), [([0, 16], "outside"), ([-1], "outside"),
                                          ([2, 3, 2], "repeat")])
def test_check_block_ids_rejects(ids, msg):
    with pytest.raises(ValueError, match=msg):
        check_block_ids(ids, 16, "source")


def test_check_block_ids_accepts():
    check_block_ids([0, 15, 7], 16, "destination")
