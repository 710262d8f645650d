"""The staging allocator: alignment, exhaustion and coalescing."""

from __future__ import annotations

import pytest

from splitserve.components.engines.torch_cpu.kv_transfer.staging import StagingAllocator

pytestmark = pytest.mark.unit


def test_alloc_aligns_and_exhausts():
    a = StagingAllocator(16 * 1024, align=4096)
    offs = [a.alloc(100), a.alloc(4096), a.alloc(5000)]
    assert offs == [0, 4096, 8192]
    assert a.used_bytes == 16 * 1024
    assert a.alloc(1) is None


def test_free_coalesces_neighbours():
    a = StagingAllocator(4 * 4096, align=4096)
    offs = [a.alloc(4096) for _ in range(4)]
    for off in (offs[1], offs[3], offs[2]):
        a.free(off)
    assert a.largest_free == 3 * 4096
    a.free(offs[0])
    assert a.largest_free == 4 * 4096 and a.used_bytes == 0
    assert a.alloc(4 * 4096) == 0


def test_zero_capacity_and_bad_align():
    assert StagingAllocator(0).alloc(1) is None
    with pytest.raises(ValueError, match="power of two"):
        StagingAllocator(4096, align=3000)
