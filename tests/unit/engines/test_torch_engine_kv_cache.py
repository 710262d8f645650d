"""KV cache manager: block tables, prefix reuse, LRU eviction and events (no model)."""

from __future__ import annotations

import pytest

from splitserve.components.engines.torch_cpu import (
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    hash_block,
)

pytestmark = pytest.mark.unit

BS = 4


def make_kv(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, num_layers=2, num_kv_heads=1, head_dim=2)


def run_seq(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    """Admit, 'compute' every token and commit, as the engine would; return cached tokens."""
    cached = kv.open_sequence(seq_id, tokens)
    assert kv.allocate(seq_id, len(tokens))
    kv.commit(seq_id, tokens, len(tokens))
    return cached


def test_pool_layout_makes_one_block_contiguous() -> None:
    kv = make_kv()
    pool = kv.pool()
    assert pool.shape == (8, 2, 2, BS, 1, 2)
    assert pool[3].is_contiguous()
    assert pool[3].data_ptr() == pool.data_ptr() + 3 * pool[0].numel() * pool.element_size()


def test_hash_is_chained_signed_64_bit_and_deterministic() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert -(2**63) <= a < 2**63
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_full_blocks_emit_stored_events_with_chain() -> None:
    kv = make_kv()
    tokens = list(range(10))  # two full blocks + 2 tokens
    run_seq(kv, "a", tokens)
    (event,) = kv.drain_events()
    h0 = hash_block(None, tokens[:4])
    assert event == BlockStored(
        block_hashes=(h0, hash_block(h0, tokens[4:8])),
        parent_hash=None,
        token_ids=tuple(tokens[:8]),
        num_block_tokens=(4, 4),
    )
    assert kv.drain_events() == []


@pytest.mark.parametrize(
    ("second", "expected_cached"),
    [
        (list(range(10)), 8),  # same prompt: both full blocks reused
        (list(range(8)), 4),  # fully cached prompt: last block recomputed for logits
        (list(range(6)) + [99, 98, 97], 4),  # diverges inside block 2
        ([7] + list(range(1, 10)), 0),  # diverges in block 1: chain broken
    ],
)
def test_prefix_reuse_takes_longest_cached_chain(second: list[int], expected_cached: int) -> None:
    kv = make_kv()
    run_seq(kv, "a", list(range(10)))
    kv.free("a")
    assert kv.open_sequence("b", second) == expected_cached
    assert len(kv.block_table("b")) == expected_cached // BS


def test_shared_blocks_are_ref_counted() -> None:
    kv = make_kv()
    run_seq(kv, "a", list(range(9)))
    assert run_seq(kv, "b", list(range(9))) == 8
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    used = kv.num_used_blocks
    kv.free("a")
    assert kv.num_used_blocks == used - 1  # only a's private tail block is released
    kv.free("b")
    assert kv.num_used_blocks == 0


def test_released_blocks_stay_cached_until_evicted_lru() -> None:
    kv = make_kv(num_blocks=4)
    run_seq(kv, "a", list(range(8)))  # 2 cached blocks
    kv.free("a")
    kv.drain_events()
    assert kv.num_cached_blocks == 2
    assert kv.open_sequence("c", list(range(100, 103))) == 0
    assert kv.allocate("c", 12)  # needs 3 of 4 blocks: 2 fresh + evicts 1 cached
    (removed,) = kv.drain_events()
    # a's tail block was released first, so it is evicted before the prefix block.
    assert removed == BlockRemoved(
        block_hashes=(hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7]),)
    )
    assert kv.num_cached_blocks == 1


def test_allocate_refuses_without_partial_allocation() -> None:
    kv = make_kv(num_blocks=2)
    kv.open_sequence("a", [1])
    assert not kv.allocate("a", 3 * BS)
    assert kv.block_table("a") == []
    assert kv.num_free_blocks == 2


def test_cached_prefix_tokens_matches_open_sequence_without_taking_blocks() -> None:
    kv = make_kv()
    toks = list(range(1, 14))
    assert kv.cached_prefix_tokens(toks) == 0
    run_seq(kv, "a", toks)
    kv.free("a")
    used = kv.num_used_blocks
    assert kv.cached_prefix_tokens(toks) == 12
    assert kv.cached_prefix_tokens(toks[:6] + [99] * 7) == 4
    assert kv.num_used_blocks == used
    assert kv.open_sequence("b", toks) == 12
