"""The router's index scores device prefixes exactly as Dynamo's ``RadixTree`` does.

``KvEventIndex.overlap`` walks its own per-tier block index instead of asking Dynamo's
tree (which answers from a thread of its own).  Both are fed the same random streams of
stores, removals and clears, over several workers and data-parallel ranks, with shared
and diverging prefixes; every lookup must score each worker the same.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from splitserve.components.router.kv_index import KvEventIndex

WORKERS = (11, 22, 33)


def block_hash(parent: int | None, local: int) -> int:
    """An engine's chained block hash: a function of the parent and the block's tokens."""
    return hash((parent, local, "block")) & ((1 << 63) - 1)


class Stream:
    """Random, well-formed KV events: a store extends a prefix the rank holds (or starts
    one) and an eviction takes blocks no held block hangs from, as an engine's cache
    stores and evicts (a running sequence pins its prefix; free blocks go leaf first)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.held: dict[tuple[int, int], dict[int, tuple[int | None, int]]] = {}
        self.event_id = 0

    def _event(self, worker: int, rank: int, data) -> dict:
        self.event_id += 1
        return {"worker_id": worker, "event": {"event_id": self.event_id, "data": data,
                                               "dp_rank": rank}}

    def next(self) -> dict:
        rng = self.rng
        worker, rank = rng.choice(WORKERS), rng.choice((0, 0, 1))
        held = self.held.setdefault((worker, rank), {})
        roll = rng.random()
        if roll < 0.02:
            held.clear()
            return self._event(worker, rank, "cleared")
        if roll < 0.25 and held:
            gone = []
            for _ in range(rng.randint(1, 4)):
                parents = {parent for parent, _ in held.values()}
                leaves = sorted(h for h in held if h not in parents)
                if not leaves:
                    break
                h = rng.choice(leaves)
                del held[h]
                gone.append(h)
            return self._event(worker, rank, {"removed": {"block_hashes": gone}})
        parent = rng.choice([None, *sorted(held)]) if held and rng.random() < 0.8 else None
        blocks = []
        for _ in range(rng.randint(1, 6)):
            local = rng.randint(1, 5)  # a small alphabet: prefixes are shared and diverge
            h = block_hash(parent, local)
            blocks.append({"block_hash": h, "tokens_hash": local})
            held[h] = (parent, local)
            parent = h
        return self._event(worker, rank, {"stored": {
            "parent_hash": None if not blocks or held[blocks[0]["block_hash"]][0] is None
            else held[blocks[0]["block_hash"]][0], "blocks": blocks}})

    def lookup(self) -> list[int]:
        return [self.rng.randint(1, 5) for _ in range(self.rng.randint(1, 10))]


def tree_scores(tree, hashes: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for key, blocks in tree.find_matches(hashes).scores.items():
        wid = key[0] if isinstance(key, tuple) else key
        if blocks:
            out[int(wid)] = max(out.get(int(wid), 0), int(blocks))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_overlap_scores_every_worker_as_dynamos_tree_does(seed):
    from dynamo.llm import RadixTree

    tree, index, stream = RadixTree(), KvEventIndex("ns", "worker"), Stream(seed)
    compared = hits = 0
    for step in range(600):
        ev = stream.next()
        tree.apply_event(ev["worker_id"], msgspec.json.encode(ev["event"]))
        index.apply([ev])
        if step % 3 == 0:
            for _ in range(4):
                q = stream.lookup()
                want = tree_scores(tree, q)
                assert index.overlap(q) == want, (step, q)
                compared += 1
                hits += bool(want)
    assert index.errors == 0
    assert hits > compared // 4, "the stream should make many prefix hits to compare"


def test_a_worker_that_leaves_scores_nothing_in_either():
    from dynamo.llm import RadixTree

    tree, index, stream = RadixTree(), KvEventIndex("ns", "worker"), Stream(99)
    for _ in range(300):
        ev = stream.next()
        tree.apply_event(ev["worker_id"], msgspec.json.encode(ev["event"]))
        index.apply([ev])
    index.known = set(WORKERS)
    index.sync_workers({11, 33})
    tree.remove_worker(22)
    for _ in range(200):
        q = stream.lookup()
        assert 22 not in index.overlap(q)
        assert index.overlap(q) == tree_scores(tree, q)


def test_an_evicted_middle_block_keeps_what_hangs_from_it_as_the_engine_does():
    """Where the two differ on purpose: Dynamo's tree drops a worker's whole subtree with
    a removed block and refuses stores beneath it.  An engine that evicts a block still
    holds the blocks after it (vLLM hashes each block by its parent, so recomputing the
    evicted one makes them reachable again), and reports their eviction later: this
    index keeps them linked, credits nothing past the gap, and counts the whole prefix
    again once the block is stored again."""
    index = KvEventIndex("ns", "worker")
    a = block_hash(None, 1)
    b = block_hash(a, 2)
    c = block_hash(b, 3)

    def ev(data):
        return {"worker_id": 11, "event": {"event_id": 0, "data": data, "dp_rank": 0}}

    index.apply([ev({"stored": {"parent_hash": None, "blocks": [
        {"block_hash": a, "tokens_hash": 1}, {"block_hash": b, "tokens_hash": 2},
        {"block_hash": c, "tokens_hash": 3}]}})])
    index.apply([ev({"removed": {"block_hashes": [b]}})])
    assert index.overlap([1, 2, 3]) == {11: 1}
    index.apply([ev({"stored": {"parent_hash": a, "blocks": [
        {"block_hash": b, "tokens_hash": 2}]}})])
    assert index.overlap([1, 2, 3]) == {11: 3}
    index.apply([ev({"removed": {"block_hashes": [c]}})])  # its own eviction, later
    assert index.overlap([1, 2, 3]) == {11: 2}
