"""Pure descriptor building: block ids -> merged (address, length, device) ranges.

One block is one contiguous byte range (``base + id * block_bytes``), so a run of
consecutive ids on *both* sides is one contiguous range on both sides and travels as one
descriptor.  Fewer, larger descriptors mean fewer UCX operations per transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

Desc = tuple[int, int, int]   # (address, length in bytes, device id), what NIXL takes


class BlockRun(NamedTuple):
    """``count`` blocks from ``src_start`` on the sender to ``dst_start`` on the receiver;
    for a staged write ``dst_start`` counts blocks from the start of the staging region."""

    src_start: int
    dst_start: int
    count: int


def check_block_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Raise ValueError unless ``ids`` are distinct and inside ``[0, num_blocks)``."""
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} outside [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{side} block ids repeat: {list(ids)[:16]}")


def merge_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    """Called before each write: pairs ``src_ids[i] -> dst_ids[i]`` merged into runs.

    A run grows while both the next source and the next destination id are one more than
    the previous ones; order is kept, so the result describes exactly the same copies.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[BlockRun] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        s, d = int(s), int(d)
        if runs:
            last = runs[-1]
            if s == last.src_start + last.count and d == last.dst_start + last.count:
                runs[-1] = last._replace(count=last.count + 1)
                continue
        runs.append(BlockRun(s, d, 1))
    return runs


def staged_runs(src_ids: Sequence[int]) -> list[BlockRun]:
    """Runs that copy ``src_ids`` in order into consecutive slots of a staging region,
    which is exactly the payload ``kv_pack(pool, src_ids)`` would build."""
    return merge_runs(src_ids, range(len(src_ids)))


def run_descs(runs: Sequence[BlockRun], *, src_base: int, dst_base: int, block_bytes: int,
              src_device: int = 0, dst_device: int = 0) -> tuple[list[Desc], list[Desc]]:
    """Called after :func:`merge_runs`: the (local, remote) descriptor lists, one entry per
    run; NIXL pairs them by index, so both lists have the same lengths entry by entry."""
    local = [(src_base + r.src_start * block_bytes, r.count * block_bytes, src_device)
             for r in runs]
    remote = [(dst_base + r.dst_start * block_bytes, r.count * block_bytes, dst_device)
              for r in runs]
    return local, remote
