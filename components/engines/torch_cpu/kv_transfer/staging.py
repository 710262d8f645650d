"""Pure first-fit allocator over a staging pool's byte range.

The receiver allocates one region per staged request when the sender asks, and frees it
after unpacking; the sender allocates one for building an FP8 payload.  Regions are
aligned so tensors of any element type can be viewed in them.
"""

from __future__ import annotations

import bisect


class StagingAllocator:
    """Hands out aligned ``[offset, offset + nbytes)`` regions of ``[0, capacity)``."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._used: dict[int, int] = {}      # offset -> reserved size

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new region of at least ``nbytes``, or None when none fits."""
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for i, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, length - size)
                self._used[start] = size
                return start
        return None

    def free(self, offset: int) -> None:
        """Return a region; neighbouring free ranges merge so large requests fit again."""
        size = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)
